// @replyd/client: the browser's half of replyd's idempotency contract.

export { ReplydClient, abortableSleep } from "./client.js";
export type {
  ClientOptions,
  FollowOptions,
  FollowStatus,
  FollowText,
  FollowUpdate,
  FollowWithdrawn,
  RequestReport,
  SendOptions,
} from "./client.js";
export { NetworkError, ProblemError, ReplydError } from "./errors.js";
export { memoryPresses, newKey, storagePresses } from "./presses.js";
export type { Press, PressStore } from "./presses.js";
export { DEFAULT_RETRY, backoffMs, fitsBudget, retryAfterMs, verdict, waitMs } from "./retry.js";
export type { RetryPolicy, Verdict } from "./retry.js";
export { TERMINAL, isTerminal } from "./types.js";
export type {
  Accepted,
  CreateReply,
  CreateToken,
  DeltaData,
  EndUserToken,
  ErasedConversation,
  ErasedEndUser,
  MessagePage,
  MessageView,
  ProblemDetails,
  ProblemKind,
  QuotaView,
  ReplyStatus,
  ReplyView,
  WithdrawnData,
} from "./types.js";
