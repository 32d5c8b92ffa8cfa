// A reverse proxy between the browser and replyd that injects the faults of the browser
// tests: an answer lost after the server did the work, an answer held back (so the page can
// be reloaded mid-request), an event stream cut after its first event, and a gateway that
// cannot stream. It records every request it saw, so the tests count what was sent.

import http from "node:http";
import type { AddressInfo } from "node:net";

export interface Seen {
  method: string;
  path: string;
  key: string | undefined;
  lastEventId: string | undefined;
  /** What replyd answered (0: the proxy answered itself). */
  status: number;
  /** The `Retry-After` replyd sent, if any. */
  retryAfter: string | undefined;
  /** The `id:` of the last event relayed, for a stream. */
  lastRelayedId: string | undefined;
  /** How the proxy treated it. */
  fault: "none" | "answer_dropped" | "answer_held" | "stream_cut" | "no_streaming";
}

export interface Faults {
  /** The next N answers to a POST are cut off (the connection drops mid-answer) once replyd answered. */
  dropPostAnswers: number;
  /** The next N answers to a POST are held this long before they are relayed. */
  holdPostAnswers: number;
  holdMs: number;
  /** The next N event streams are cut after their first event. */
  cutStreams: number;
  /** Every event stream request is answered 502 by the proxy itself. */
  noStreaming: boolean;
}

export const NO_FAULTS: Faults = { dropPostAnswers: 0, holdPostAnswers: 0, holdMs: 0, cutStreams: 0, noStreaming: false };

export class FaultProxy {
  seen: Seen[] = [];
  faults: Faults = { ...NO_FAULTS };
  private readonly server: http.Server;
  private readonly agent = new http.Agent({ keepAlive: false });

  constructor(private readonly upstream: URL) {
    this.server = http.createServer((req, res) => this.relay(req, res));
  }

  async listen(): Promise<string> {
    await new Promise<void>((resolve) => this.server.listen(0, "127.0.0.1", resolve));
    return `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
  }

  reset(): void {
    this.seen = [];
    this.faults = { ...NO_FAULTS };
  }

  async close(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
    this.agent.destroy();
  }

  private relay(req: http.IncomingMessage, res: http.ServerResponse): void {
    const header = (name: string) => {
      const value = req.headers[name];
      return Array.isArray(value) ? value[0] : value;
    };
    const seen: Seen = {
      method: req.method ?? "GET",
      path: req.url ?? "/",
      key: header("idempotency-key"),
      lastEventId: header("last-event-id"),
      status: 0,
      retryAfter: undefined,
      lastRelayedId: undefined,
      fault: "none",
    };
    this.seen.push(seen);
    const stream = seen.method === "GET" && /\/events(\?|$)/.test(seen.path);
    if (stream && this.faults.noStreaming) {
      seen.fault = "no_streaming";
      req.resume();
      res.writeHead(502, { "content-type": "text/html" }).end("<html><body>502 Bad Gateway</body></html>");
      return;
    }
    let fault: Seen["fault"] = "none";
    if (seen.method === "POST" && this.faults.dropPostAnswers > 0) {
      this.faults.dropPostAnswers--;
      fault = "answer_dropped";
    } else if (seen.method === "POST" && this.faults.holdPostAnswers > 0) {
      this.faults.holdPostAnswers--;
      fault = "answer_held";
    } else if (stream && this.faults.cutStreams > 0) {
      this.faults.cutStreams--;
      fault = "stream_cut";
    }
    seen.fault = fault;
    const headers = { ...req.headers, host: this.upstream.host };
    const upstream = http.request(
      { host: this.upstream.hostname, port: this.upstream.port, path: seen.path, method: seen.method, headers, agent: this.agent },
      (answer) => {
        seen.status = answer.statusCode ?? 0;
        const retryAfter = answer.headers["retry-after"];
        seen.retryAfter = Array.isArray(retryAfter) ? retryAfter[0] : retryAfter;
        if (fault === "answer_dropped") {
          // replyd has answered (the work is saved); the browser gets the head and half the
          // body, then the connection drops. (With no byte at all, Chromium itself resends a
          // POST whose reused connection failed: the same request, the same key, but not the
          // client's retry this test is after.)
          const chunks: Buffer[] = [];
          answer.on("data", (chunk: Buffer) => chunks.push(chunk));
          answer.on("end", () => {
            const body = Buffer.concat(chunks);
            res.writeHead(answer.statusCode ?? 502, answer.headers);
            res.write(body.subarray(0, Math.floor(body.length / 2)), () => res.socket?.destroy());
          });
          return;
        }
        if (fault === "answer_held") {
          const chunks: Buffer[] = [];
          answer.on("data", (chunk: Buffer) => chunks.push(chunk));
          answer.on("end", () => {
            setTimeout(() => {
              if (res.destroyed) return; // the page went away meanwhile
              res.writeHead(answer.statusCode ?? 502, answer.headers).end(Buffer.concat(chunks));
            }, this.faults.holdMs || 1_500);
          });
          return;
        }
        res.writeHead(answer.statusCode ?? 502, answer.headers);
        res.flushHeaders();
        let text = "";
        let cutting = false;
        answer.on("data", (chunk: Buffer) => {
          res.write(chunk);
          if (!stream) return;
          text += chunk.toString("utf8");
          for (const match of text.matchAll(/^id: ?(.*)$/gm)) seen.lastRelayedId = match[1];
          if (fault === "stream_cut" && text.includes("\n\n") && !cutting) {
            // A moment after the first event: drop both sides mid-body (the chunked body never
            // ends). Not at once: Chromium fails a truncated body without handing over the
            // bytes that arrived just before, so the event would never reach the page.
            cutting = true;
            setTimeout(() => {
              answer.destroy();
              res.socket?.end();
            }, 300);
          }
        });
        answer.on("end", () => res.end());
        answer.on("error", () => res.socket?.destroy());
      },
    );
    upstream.on("error", () => {
      if (!res.headersSent) res.writeHead(502, { "content-type": "text/plain" }).end("upstream error");
      else res.socket?.destroy();
    });
    req.pipe(upstream);
  }
}
