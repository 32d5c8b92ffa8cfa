//! Tools that try replyd from outside, as its users' systems would, and are no part of the
//! service: a mock LLM provider that behaves like the hosted APIs it stands for
//! ([`mock_provider`]), simulated browsers pressing Send against the API ([`browsers`]), and a
//! producer of reply-task records ([`produce`], and [`sqs`] for a queue), and a product's own
//! server that signs its users in with end-user tokens ([`product`]). The tests, the benchmarks, the chaos harness
//! and the demo run them; the `replyd` binary and its image hold none of them.

pub mod browsers;
pub mod mock_provider;
pub mod produce;
pub mod product;
pub mod sqs;
