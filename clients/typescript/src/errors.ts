// The errors a call ends with. Each says whether the press it belongs to is settled: a
// settled press will never become a task under its key, an unsettled one may still (or may
// already have), so its key is kept and reused.

import type { ProblemDetails, ProblemKind } from "./types.js";

/** Every error of this client. */
export class ReplydError extends Error {
  /** Requests sent for the call, retries included. */
  readonly requests: number;

  constructor(message: string, requests: number, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "ReplydError";
    this.requests = requests;
  }
}

/** The server answered with a problem (RFC 9457, `application/problem+json`). */
export class ProblemError extends ReplydError {
  readonly status: number;
  readonly problem: ProblemDetails;
  /** When the server said to try again (`Retry-After`), as a moment, if it said. */
  readonly retryAt: Date | undefined;

  constructor(problem: ProblemDetails, requests: number, retryAt: Date | undefined) {
    super(`${problem.status} ${problem.title}: ${problem.detail}`, requests);
    this.name = "ProblemError";
    this.status = problem.status;
    this.problem = problem;
    this.retryAt = retryAt;
  }

  /**
   * The problem's stable name: the last segment of its `type` (e.g. `quota_exceeded`), one of
   * the document's `ProblemKind`s (a server newer than this client may answer with another).
   */
  get kind(): ProblemKind {
    const type = this.problem.type;
    return type.slice(type.lastIndexOf("/") + 1) as ProblemKind;
  }

  /**
   * Whether the request itself is wrong (a 4xx other than 408, 409, 425 and 429), or can
   * never succeed (`task_finished`: a cancel of a task that had already ended, which is a 409
   * but no concurrent request): the press is settled and is never sent again under its key.
   */
  get refused(): boolean {
    if (this.kind === "task_finished") return true;
    return this.status >= 400 && this.status < 500 && ![408, 409, 425, 429].includes(this.status);
  }
}

/**
 * No answer came within the budget: every request failed on the network or timed out. The
 * server may have done the work; the press keeps its key, so sending it again (`resume`)
 * cannot make a second task.
 */
export class NetworkError extends ReplydError {
  constructor(message: string, requests: number, cause: unknown) {
    super(message, requests, { cause });
    this.name = "NetworkError";
  }
}
