//! Request headers that must not be ambiguous.

use axum::http::{HeaderMap, HeaderValue};

/// The one value of a header that must not be ambiguous (`Authorization`,
/// `Idempotency-Key`): `None` when absent; the same value repeated is that value; different
/// values are `Err` with how many there are.
pub fn one_value<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a HeaderValue>, usize> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    let mut distinct = vec![first];
    for value in values {
        if !distinct.contains(&value) {
            distinct.push(value);
        }
    }
    match distinct.len() {
        1 => Ok(Some(first)),
        n => Err(n),
    }
}
