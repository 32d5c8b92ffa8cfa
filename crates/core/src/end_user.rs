//! End-user tokens, pure: what a product's page holds instead of the workspace's key. The
//! product's backend (which holds the key) asks for one per end user (`POST
//! /v1/end-user-tokens`); it is a JWT (RFC 7519) signed with HS256 by the workspace's signing
//! secret of one version (the header's `kid`), naming the workspace, the user, the API key
//! that asked for it, when it was issued and when it ends, and the user's token generation. A
//! token may create replies in its user's conversations, read them, follow them and stop
//! them, nothing else. It dies with whichever ends first: its own lifetime (at most
//! `api.end_user_token_max_ttl_seconds`, checked on the way in too, so no token lives longer
//! whoever signed it), the key that asked for it (revoked), the user's generation (moved on by
//! a revocation), or its signing secret's version (retired by a rotation, after its overlap).
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
    /// The id of the API key that asked for the token: it dies with the key.
    pub key: String,
}

/// How far ahead of this process's clock a token's `iat` may be: the API processes that sign
/// tokens keep their clocks in step to within this. A later `iat` is a forgery's or a broken
/// clock's, and is refused.
pub const ISSUED_AT_LEEWAY_S: i64 = 5;

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
    #[error(
        "the API key that asked for this end-user token was revoked; get a new one from the product's backend"
    )]
    KeyRevoked,
    #[error(
        "the API key that asked for this end-user token has expired; get a new one from the product's backend"
    )]
    KeyExpired,
    #[error(
        "the end-user token lives {lifetime} s, longer than the {max} s a token may (api.end_user_token_max_ttl_seconds)"
    )]
    TooLong { lifetime: i64, max: i64 },
    #[error("the end-user token's iat is {0} s ahead of this server's clock")]
    IssuedInTheFuture(i64),
    #[error("end-user tokens are not enabled on this deployment (api.end_user_token_key is unset)")]
    Disabled,
}

/// What a token says of itself before anything of it is trusted: which signing secret
/// (workspace and version) to verify it with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub workspace: String,
    pub user: String,
    /// The signing secret's version, the header's `kid`.
    pub version: i32,
}

/// Who asks for a token: the key's workspace and id.
#[derive(Debug, Clone, Copy)]
pub struct Issuer<'a> {
    pub workspace: &'a str,
    pub key_id: &'a str,
}

/// A token for `user`, asked for by `issuer`, signed with version `version` of the
/// workspace's secret, valid from `now` for `ttl_s` seconds.
pub fn mint(
    secret: &[u8],
    version: i32,
    issuer: Issuer<'_>,
    user: &str,
    generation: i64,
    now: i64,
    ttl_s: i64,
) -> String {
    let claims = Claims {
        iss: ISSUER.to_owned(),
        sub: user.to_owned(),
        ws: issuer.workspace.to_owned(),
        iat: now,
        exp: now.saturating_add(ttl_s),
        generation,
        key: issuer.key_id.to_owned(),
    };
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some(version.to_string());
    jsonwebtoken::encode(&header, &claims, &EncodingKey::from_secret(secret))
        .expect("HS256 over serializable claims cannot fail")
}

/// The workspace, user and signing secret's version a token names, unverified: which secret
/// to read before [`verify`]. Nothing is trusted until `verify` says so. A token without a
/// `kid` (signed before secrets were versioned) or without the key that asked for it is
/// malformed: it names nothing that can verify it.
pub fn named(token: &str) -> Result<Named, TokenError> {
    let header = jsonwebtoken::decode_header(token).map_err(|_| TokenError::Malformed)?;
    let version = header
        .kid
        .and_then(|kid| kid.parse::<i32>().ok())
        .filter(|v| *v > 0)
        .ok_or(TokenError::Malformed)?;
    let mut validation = Validation::new(Algorithm::HS256);
    validation.insecure_disable_signature_validation();
    validation.validate_exp = false;
    validation.required_spec_claims.clear();
    let data = jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_secret(&[]), &validation)
        .map_err(|_| TokenError::Malformed)?;
    Ok(Named {
        workspace: data.claims.ws,
        user: data.claims.sub,
        version,
    })
}

/// The token's claims, if its signature verifies under `secret`, it names this issuer, it was
/// not issued in the future, it lives no longer than `max_lifetime_s`, and it has not expired
/// at `now`. Whether its user, key and secret still stand is [`Claims::standing`]'s.
pub fn verify(
    token: &str,
    secret: &[u8],
    now: i64,
    max_lifetime_s: i64,
) -> Result<Claims, TokenError> {
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
    if claims.iat > now.saturating_add(ISSUED_AT_LEEWAY_S) {
        return Err(TokenError::IssuedInTheFuture(claims.iat - now));
    }
    let lifetime = claims.exp.saturating_sub(claims.iat);
    if lifetime > max_lifetime_s {
        return Err(TokenError::TooLong {
            lifetime,
            max: max_lifetime_s,
        });
    }
    if claims.exp <= now {
        return Err(TokenError::Expired(now - claims.exp));
    }
    Ok(claims)
}

/// Where the API key that asked for a token stands now: a token lives no longer than its key,
/// and its holder hears which end came (a revoked key is someone's decision, an expired one
/// the calendar's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AskingKey {
    Live,
    Revoked,
    Expired,
}

impl Claims {
    /// Whether a verified token still stands: the user's `generation` now is the token's, and
    /// the key that asked for it is live.
    pub fn standing(&self, generation: i64, key: AskingKey) -> Result<(), TokenError> {
        match key {
            AskingKey::Live => {}
            AskingKey::Revoked => return Err(TokenError::KeyRevoked),
            AskingKey::Expired => return Err(TokenError::KeyExpired),
        }
        if self.generation != generation {
            return Err(TokenError::Revoked);
        }
        Ok(())
    }
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
    const MAX: i64 = 3_600;
    const ACME: Issuer<'static> = Issuer {
        workspace: "acme",
        key_id: "k1",
    };

    fn token(user: &str, generation: i64, ttl: i64) -> String {
        mint(SECRET, 3, ACME, user, generation, NOW, ttl)
    }

    #[test]
    fn a_minted_token_verifies_until_it_expires_and_names_its_user_key_and_version() {
        let token = token("user-a", 0, 900);
        assert!(looks_like_token(&token));
        assert_eq!(
            named(&token),
            Ok(Named {
                workspace: "acme".into(),
                user: "user-a".into(),
                version: 3
            })
        );
        let claims = verify(&token, SECRET, NOW + 899, MAX).unwrap();
        assert_eq!(
            (claims.ws.as_str(), claims.sub.as_str(), claims.key.as_str()),
            ("acme", "user-a", "k1")
        );
        assert_eq!(claims.standing(0, AskingKey::Live), Ok(()));
        assert_eq!(
            verify(&token, SECRET, NOW + 900, MAX),
            Err(TokenError::Expired(0))
        );
        assert_eq!(
            verify(&token, SECRET, NOW + 960, MAX),
            Err(TokenError::Expired(60))
        );
    }

    #[test]
    fn another_secret_a_changed_claim_a_moved_generation_or_a_revoked_key_is_refused() {
        let token = token("user-a", 3, 900);
        assert_eq!(
            verify(&token, b"another secret, 32 bytes long!!!", NOW, MAX),
            Err(TokenError::BadSignature)
        );
        let claims = verify(&token, SECRET, NOW, MAX).unwrap();
        assert_eq!(
            claims.standing(4, AskingKey::Live),
            Err(TokenError::Revoked)
        );
        assert_eq!(
            claims.standing(3, AskingKey::Revoked),
            Err(TokenError::KeyRevoked)
        );
        assert_eq!(
            claims.standing(3, AskingKey::Expired),
            Err(TokenError::KeyExpired)
        );
        // The user's id swapped in the payload: the signature no longer covers it.
        let [header, _, signature]: [&str; 3] =
            token.split('.').collect::<Vec<_>>().try_into().unwrap();
        let other = mint(SECRET, 3, ACME, "user-b", 3, NOW, 900);
        let payload = other.split('.').nth(1).unwrap();
        let forged = format!("{header}.{payload}.{signature}");
        assert_eq!(
            verify(&forged, SECRET, NOW, MAX),
            Err(TokenError::BadSignature)
        );
        assert_eq!(
            verify("a.b.c", SECRET, NOW, MAX),
            Err(TokenError::Malformed)
        );
    }

    #[test]
    fn no_token_lives_longer_than_the_setting_or_begins_in_the_future_whoever_signed_it() {
        // Signed with the right secret (as one who read it could), for 2100.
        let forever = mint(SECRET, 3, ACME, "user-a", 0, NOW, 4_102_444_800 - NOW);
        assert!(matches!(
            verify(&forever, SECRET, NOW, MAX),
            Err(TokenError::TooLong { max: MAX, .. })
        ));
        assert_eq!(
            verify(&token("user-a", 0, MAX), SECRET, NOW, MAX).map(|c| c.exp),
            Ok(NOW + MAX),
            "the longest lifetime is taken"
        );
        let ahead = mint(SECRET, 3, ACME, "user-a", 0, NOW + 60, 900);
        assert_eq!(
            verify(&ahead, SECRET, NOW, MAX),
            Err(TokenError::IssuedInTheFuture(60))
        );
        let skewed = mint(SECRET, 3, ACME, "user-a", 0, NOW + ISSUED_AT_LEEWAY_S, 900);
        assert!(
            verify(&skewed, SECRET, NOW, MAX).is_ok(),
            "within the leeway"
        );
    }

    #[test]
    fn a_token_without_a_version_or_a_key_names_nothing() {
        // Shaped as tokens were signed before secrets had versions and tokens named their key.
        #[derive(Serialize)]
        struct Before<'a> {
            iss: &'a str,
            sub: &'a str,
            ws: &'a str,
            iat: i64,
            exp: i64,
            generation: i64,
        }
        let before = Before {
            iss: ISSUER,
            sub: "user-a",
            ws: "acme",
            iat: NOW,
            exp: NOW + 900,
            generation: 0,
        };
        let unversioned = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &before,
            &EncodingKey::from_secret(SECRET),
        )
        .unwrap();
        assert_eq!(named(&unversioned), Err(TokenError::Malformed));
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some("3".into());
        let keyless =
            jsonwebtoken::encode(&header, &before, &EncodingKey::from_secret(SECRET)).unwrap();
        assert_eq!(named(&keyless), Err(TokenError::Malformed));
        assert_eq!(
            verify(&keyless, SECRET, NOW, MAX),
            Err(TokenError::Malformed)
        );
    }

    #[test]
    fn an_unsigned_token_is_refused() {
        // `alg: none`, the classic forgery.
        let header = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIiwia2lkIjoiMyJ9";
        let token = token("user-a", 0, 900);
        let payload = token.split('.').nth(1).unwrap();
        let forged = format!("{header}.{payload}.x");
        assert!(verify(&forged, SECRET, NOW, MAX).is_err());
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
