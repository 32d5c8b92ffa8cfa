//! The path parameter of a route (`{task_id}`, `{conversation_id}`, `{user_id}`), read by one
//! extractor, [`PathParam`], which every route with a parameter takes in place of axum's
//! `Path`: so every route refuses a segment that can be no id in one way, a `400
//! invalid_path` problem naming the segment, where axum's own rejection is a `text/plain`
//! answer. A segment is refused when it is not UTF-8 once percent-decoded, or when it holds a
//! NUL (`%00`), which PostgreSQL's text cannot hold (so it would fail the query, a `5xx`,
//! rather than find nothing). What the segment means (a UUID, a conversation that exists) is
//! each route's own concern, judged after this.
//!
//! Order: the handlers take the caller ([`super::auth::Caller`] or
//! [`super::auth::Workspace`]) before the path, and axum runs extractors in order, so who
//! asks is settled first: a request without a valid credential is a `401` (an end user's
//! token on a route of the key a `403`) whatever its path holds, and only an authenticated
//! caller, counted by its rate limit, learns that its path is malformed.

use axum::extract::rejection::PathRejection;
use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;

use super::problem::{Problem, ProblemKind};

/// The text of a route's one path parameter, percent-decoded, UTF-8, without NUL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathParam(pub String);

/// Why a path segment can be no id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentFault {
    /// Its bytes, percent-decoded, are not UTF-8.
    NotUtf8,
    /// It holds a NUL character.
    Nul,
    /// The router gave no parameter to read (a route declared without one).
    Unreadable,
}

impl SegmentFault {
    /// The `400 invalid_path` of a segment `{name}` with this fault.
    pub fn problem(self, name: &str) -> Problem {
        let detail = match self {
            SegmentFault::NotUtf8 => format!(
                "the path segment `{{{name}}}` is not UTF-8 once percent-decoded; send it as UTF-8, percent-encoded"
            ),
            SegmentFault::Nul => format!(
                "the path segment `{{{name}}}` holds a NUL character (%00), which no id may hold"
            ),
            SegmentFault::Unreadable => "the path's parameter cannot be read".to_owned(),
        };
        Problem::bad_request(ProblemKind::InvalidPath, detail)
    }
}

/// The fault of a decoded segment, if it has one.
pub fn fault_of(value: &str) -> Option<SegmentFault> {
    value.contains('\0').then_some(SegmentFault::Nul)
}

/// The problem of axum's rejection: only a segment that is not UTF-8 can be the caller's
/// doing (the others come from a route declared without a parameter).
fn rejected(rejection: &PathRejection) -> Problem {
    use axum::extract::path::ErrorKind;
    match rejection {
        PathRejection::FailedToDeserializePathParams(failed) => match failed.kind() {
            ErrorKind::InvalidUtf8InPathParam { key } => SegmentFault::NotUtf8.problem(key),
            _ => SegmentFault::Unreadable.problem(""),
        },
        _ => SegmentFault::Unreadable.problem(""),
    }
}

impl<S: Send + Sync> FromRequestParts<S> for PathParam {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        // Pairs, not a bare string, so the segment's name is at hand for its problem.
        let Path(params) = Path::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(|rejection| rejected(&rejection))?;
        // Every route has at most one parameter.
        let Some((name, value)) = params.into_iter().next() else {
            return Err(SegmentFault::Unreadable.problem(""));
        };
        match fault_of(&value) {
            Some(fault) => Err(fault.problem(&name)),
            None => Ok(PathParam(value)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn a_segment_with_a_nul_anywhere_is_refused_and_any_other_text_passes() {
        for bad in ["\0", "conv\0", "\0x", "a\0b"] {
            assert_eq!(fault_of(bad), Some(SegmentFault::Nul), "{bad:?}");
        }
        for good in ["conv-1", "é", "a b", "\u{1}", ""] {
            assert_eq!(fault_of(good), None, "{good:?}");
        }
    }

    #[test]
    fn each_fault_is_a_400_naming_the_segment() {
        for fault in [SegmentFault::NotUtf8, SegmentFault::Nul] {
            let problem = fault.problem("task_id");
            assert_eq!(
                (problem.status, problem.kind),
                (StatusCode::BAD_REQUEST, ProblemKind::InvalidPath)
            );
            assert!(problem.detail.contains("`{task_id}`"), "{}", problem.detail);
        }
    }
}
