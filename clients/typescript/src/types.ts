// The API's types, by name. `openapi.ts` is generated from docs/openapi.json (`npm run
// generate`), and `npm run check` fails when it is not what the document gives, so these are
// the server's own schemas.

import type { components } from "./openapi.js";

type Schemas = components["schemas"];

export type Accepted = Schemas["Accepted"];
export type CreateReply = Schemas["CreateReply"];
export type CreateToken = Schemas["CreateToken"];
/** A piece of a running attempt's text, as a follow's `delta` event carries it. */
export type DeltaData = Schemas["DeltaData"];
/** What the product's backend gets for one end user (`POST /v1/end-user-tokens`). */
export type EndUserToken = Schemas["EndUserToken"];
export type ErasedConversation = Schemas["ErasedConversation"];
export type ErasedEndUser = Schemas["ErasedEndUser"];
export type MessagePage = Schemas["MessagePage"];
export type MessageView = Schemas["MessageView"];
export type ProblemDetails = Schemas["ProblemDetails"];
/** Every kind of problem the API answers with: the last segment of a problem's `type`. */
export type ProblemKind = Schemas["ProblemKind"];
export type QuotaView = Schemas["QuotaView"];
export type ReplyStatus = Schemas["ReplyStatus"];
export type ReplyView = Schemas["ReplyView"];
/** An attempt whose text will not be saved, as a follow's `withdrawn` event carries it. */
export type WithdrawnData = Schemas["WithdrawnData"];

/** The states after which a task never changes. */
export const TERMINAL: ReadonlySet<ReplyStatus> = new Set<ReplyStatus>(["completed", "failed", "cancelled"]);

export function isTerminal(status: ReplyStatus): boolean {
  return TERMINAL.has(status);
}
