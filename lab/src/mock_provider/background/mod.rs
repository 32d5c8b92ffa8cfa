//! The mock's background responses, kept pure: the book of responses and their states
//! (`queued` → `in_progress` → `completed` or `failed`), the `Idempotency-Key` → response id
//! map that makes a re-sent create find the first response instead of generating again (I6),
//! the validation of a create body, and the JSON of a response object. The server module does
//! the I/O (the spawned generation, the routes, the counters) around it.
//!
//! A response can be retrieved only within its retention after it ended (OpenAI keeps one
//! about ten minutes unless stored): after it, the book forgets the response and its key, so a
//! lookup is 404 and a client that waited too long has no recovery left. Time is a monotonic
//! offset supplied by the caller.
//!
//! A response created with `stream: true` keeps every event of its stream, numbered from 0 by
//! its `sequence_number`, as each step of its life records it: `response.created`, then
//! `response.in_progress`, the output item and its text part opened, the text's deltas, their
//! close, and `response.completed` (or `response.failed` at any point). That log is what lets a
//! client whose connection broke resume with `starting_after` and lose nothing, as OpenAI's
//! background streams do; it is forgotten with the response.
//!
//! Each concern is a room of its own: [`state`] (a response and where it is in its life),
//! [`book`] (the book of responses, their keys, retention and event logs), [`object`] (the
//! JSON the API answers), [`request`] (what the mock reads of a create and of a resume) and
//! [`faults`] (which faults fail the response and which only its connection). The server
//! module names them all from here.

pub mod book;
pub mod faults;
pub mod object;
pub mod request;
pub mod state;

pub use book::{Creation, Replay, ResponseBook};
pub use faults::{connection_fault, generation_failure};
pub use object::{not_streamable_body, response_object};
pub use request::{CreateRequest, InputMessage, parse_create, parse_resume};
pub use state::{Output, ResponseEntry, ResponseState};
