//! End-user tokens, pure: what a product's page holds instead of the workspace's key. The
//! product's backend (which holds the key) asks for one per end user (`POST
//! /v1/end-user-tokens`); it is a JWT (RFC 7519) signed with HS256 by the workspace's own
//! signing secret, naming the workspace, the user, when it ends, and the user's token
//! generation. A token may create replies in its user's conversations, read them, follow them
//! and stop them, nothing else; it expires on its own, and every token of a user is revoked at
//! once by moving the user's generation on.
//!
//! Signing and verifying are `jsonwebtoken`'s; the time is the caller's (`now`), so expiry is
//! decided here, testably, and not by the library's clock.

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

/// The `iss` of every token, checked on the way in.
pub const ISSUER: &str = "replyd";
/// Most bytes of an end user's id.
pub const MAX_USER_ID_BYTES: usize = 256;
/// Bytes of a workspace's signing secret (HS256 wants at least its hash's 32).
pub const SECRET_BYTES: usize = 32;

/// What a token says; signed, so each field is as the API wrote it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub iss: String,
    /// The end user.
    pub sub: String,
    /// The workspace.
    pub ws: String,
    /// Issued at, seconds since the epoch.
    pub iat: i64,
    /// Ends at, seconds since the epoch.
    pub exp: i64,
    /// The user's token generation when it was issued: a revocation moves it on.
    pub generation: i64,
}

/// Why a token is not taken. Each is a `401`; the detail says which, since a product's
/// backend must tell an expired token (refresh it) from a revoked one (sign the user out).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("the bearer token is not an API key (rpd_…) or an end-user token (a JWT)")]
    Malformed,
    #[error("the end-user token's signature does not verify")]
    BadSignature,
    #[error("the end-user token expired {0} s ago; get a new one from the product's backend")]
    Expired(i64),
    #[error("the end-user token was revoked; get a new one from the product's backend")]
    Revoked,
}

/// A token for `user` of `workspace`, valid from `now` for `ttl_s` seconds.
pub fn mint(
    secret: &[u8],
    workspace: &str,
    user: &str,
    generation: i64,
    now: i64,
    ttl_s: i64,
) -> String {
    let claims = Claims {
        iss: ISSUER.to_owned(),
        sub: user.to_owned(),
        ws: workspace.to_owned(),
        iat: now,
        exp: now.saturating_add(ttl_s),
        generation,
    };
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret),
    )
    .expect("HS256 over serializable claims cannot fail")
}

/// The workspace and user a token names, unverified: which signing secret and generation to
/// read before [`verify`]. Nothing is trusted until `verify` says so.
pub fn named(token: &str) -> Result<(String, String), TokenError> {
    let mut validation = Validation::new(Algorithm::HS256);
    validation.insecure_disable_signature_validation();
    validation.validate_exp = false;
    validation.required_spec_claims.clear();
    let data = jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_secret(&[]), &validation)
        .map_err(|_| TokenError::Malformed)?;
    Ok((data.claims.ws, data.claims.sub))
}

/// The token's claims, if its signature verifies under `secret`, it names this issuer, it has
/// not expired at `now`, and its generation is the user's `generation`.
pub fn verify(token: &str, secret: &[u8], now: i64, generation: i64) -> Result<Claims, TokenError> {
    let mut validation = Validation::new(Algorithm::HS256);
    validation.set_issuer(&[ISSUER]);
    validation.validate_exp = false;
    validation.leeway = 0;
    validation.set_required_spec_claims(&["exp", "iss", "sub"]);
    let claims =
        jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_secret(secret), &validation)
            .map_err(|e| match e.kind() {
                jsonwebtoken::errors::ErrorKind::InvalidSignature => TokenError::BadSignature,
                _ => TokenError::Malformed,
            })?
            .claims;
    if claims.exp <= now {
        return Err(TokenError::Expired(now - claims.exp));
    }
    if claims.generation != generation {
        return Err(TokenError::Revoked);
    }
    Ok(claims)
}

/// Whether a bearer credential is a JWT rather than an API key: three base64url parts.
pub fn looks_like_token(credential: &str) -> bool {
    let parts: Vec<&str> = credential.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// A user id the API takes: not blank, at most [`MAX_USER_ID_BYTES`], no control characters.
pub fn check_user_id(user: &str) -> Result<(), String> {
    if user.trim().is_empty() {
        return Err("`user_id` is empty".into());
    }
    if user.len() > MAX_USER_ID_BYTES {
        return Err(format!(
            "`user_id` is {} bytes, over the limit of {MAX_USER_ID_BYTES} bytes",
            user.len()
        ));
    }
    if user.chars().any(char::is_control) {
        return Err("`user_id` contains a control character".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    const NOW: i64 = 1_800_000_000;

    #[test]
    fn a_minted_token_verifies_until_it_expires_and_names_its_user() {
        let token = mint(SECRET, "acme", "user-a", 0, NOW, 900);
        assert!(looks_like_token(&token));
        assert_eq!(named(&token), Ok(("acme".into(), "user-a".into())));
        let claims = verify(&token, SECRET, NOW + 899, 0).unwrap();
        assert_eq!(
            (claims.ws.as_str(), claims.sub.as_str()),
            ("acme", "user-a")
        );
        assert_eq!(
            verify(&token, SECRET, NOW + 900, 0),
            Err(TokenError::Expired(0))
        );
        assert_eq!(
            verify(&token, SECRET, NOW + 960, 0),
            Err(TokenError::Expired(60))
        );
    }

    #[test]
    fn another_secret_a_changed_claim_or_a_moved_generation_is_refused() {
        let token = mint(SECRET, "acme", "user-a", 3, NOW, 900);
        assert_eq!(
            verify(&token, b"another secret, 32 bytes long!!!", NOW, 3),
            Err(TokenError::BadSignature)
        );
        assert_eq!(verify(&token, SECRET, NOW, 4), Err(TokenError::Revoked));
        // The user's id swapped in the payload: the signature no longer covers it.
        let [header, _, signature]: [&str; 3] =
            token.split('.').collect::<Vec<_>>().try_into().unwrap();
        let other = mint(SECRET, "acme", "user-b", 3, NOW, 900);
        let payload = other.split('.').nth(1).unwrap();
        let forged = format!("{header}.{payload}.{signature}");
        assert_eq!(
            verify(&forged, SECRET, NOW, 3),
            Err(TokenError::BadSignature)
        );
        assert_eq!(verify("a.b.c", SECRET, NOW, 3), Err(TokenError::Malformed));
    }

    #[test]
    fn an_unsigned_token_is_refused() {
        // `alg: none`, the classic forgery.
        let header = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0";
        let token = mint(SECRET, "acme", "user-a", 0, NOW, 900);
        let payload = token.split('.').nth(1).unwrap();
        let forged = format!("{header}.{payload}.x");
        assert!(verify(&forged, SECRET, NOW, 0).is_err());
    }

    #[test]
    fn an_api_key_is_not_a_token_and_user_ids_are_bounded() {
        assert!(!looks_like_token("rpd_0123456789abcdef_secret"));
        assert!(check_user_id("u-1").is_ok());
        assert!(check_user_id(" ").is_err());
        assert!(check_user_id(&"x".repeat(257)).is_err());
        assert!(check_user_id("a\nb").is_err());
    }
}
