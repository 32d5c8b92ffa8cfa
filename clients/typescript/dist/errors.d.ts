import type { ProblemDetails, ProblemKind } from "./types.js";
/** Every error of this client. */
export declare class ReplydError extends Error {
    /** Requests sent for the call, retries included. */
    readonly requests: number;
    constructor(message: string, requests: number, options?: {
        cause?: unknown;
    });
}
/** The server answered with a problem (RFC 9457, `application/problem+json`). */
export declare class ProblemError extends ReplydError {
    readonly status: number;
    readonly problem: ProblemDetails;
    /** When the server said to try again (`Retry-After`), as a moment, if it said. */
    readonly retryAt: Date | undefined;
    constructor(problem: ProblemDetails, requests: number, retryAt: Date | undefined);
    /**
     * The problem's stable name: the last segment of its `type` (e.g. `quota_exceeded`), one of
     * the document's `ProblemKind`s (a server newer than this client may answer with another).
     */
    get kind(): ProblemKind;
    /**
     * Whether the request itself is wrong (a 4xx other than 408, 409, 425 and 429), or can
     * never succeed (`task_finished`: a cancel of a task that had already ended, which is a 409
     * but no concurrent request): the press is settled and is never sent again under its key.
     */
    get refused(): boolean;
}
/**
 * No answer came within the budget: every request failed on the network or timed out. The
 * server may have done the work; the press keeps its key, so sending it again (`resume`)
 * cannot make a second task.
 */
export declare class NetworkError extends ReplydError {
    constructor(message: string, requests: number, cause: unknown);
}
