//! API keys, pure: a key is random, shown once, and stored only as its SHA-256 (the convention
//! for high-entropy keys: no salt or slow hash is needed when the key itself carries 256 bits).
//! A key reads `rpd_<key id>_<secret>`: the id finds the row, the hash of the whole key is
//! compared in constant time, so neither a lookup nor a comparison leaks the secret.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::idempotency::hex;

/// Every key starts with this, so a leaked one is easy to recognise (secret scanners).
pub const PREFIX: &str = "rpd";

/// A key just made: `token` is shown once to the operator; only `key_id` and `hash` are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedKey {
    pub key_id: String,
    pub token: String,
    pub hash: String,
}

/// A key as presented in `Authorization: Bearer <key>`, hashed at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PresentedKey {
    pub key_id: String,
    pub hash: String,
}

/// Why a request is not authenticated; every one is a `401` that says what to send.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("no Authorization header: send `Authorization: Bearer <API key>`")]
    Missing,
    #[error("the Authorization header is not `Bearer <API key>`")]
    NotBearer,
    #[error("the API key is not a replyd key (`{PREFIX}_<id>_<secret>`)")]
    Malformed,
    #[error("the API key is unknown or revoked")]
    Unknown,
    /// Said only to a caller that presented the key itself (its hash matched).
    #[error("the API key expired at {0}; make a new one with `replyd api-key create`")]
    Expired(String),
}

/// Makes a new key from 8 random bytes of id and 32 of secret.
pub fn issue(rng: &mut impl RngCore) -> IssuedKey {
    let mut id = [0u8; 8];
    let mut secret = [0u8; 32];
    rng.fill_bytes(&mut id);
    rng.fill_bytes(&mut secret);
    let key_id = hex(&id);
    let token = format!("{PREFIX}_{key_id}_{}", URL_SAFE_NO_PAD.encode(secret));
    let hash = hash_of(&token);
    IssuedKey {
        key_id,
        token,
        hash,
    }
}

/// SHA-256 of a whole key, hex.
pub fn hash_of(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

/// Parses `Authorization: Bearer rpd_<id>_<secret>` (`None` when the header is absent).
pub fn parse_bearer(header: Option<&[u8]>) -> Result<PresentedKey, AuthError> {
    let header = header.ok_or(AuthError::Missing)?;
    let header = std::str::from_utf8(header).map_err(|_| AuthError::NotBearer)?;
    let (scheme, token) = header.trim().split_once(' ').ok_or(AuthError::NotBearer)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::NotBearer);
    }
    let token = token.trim();
    let mut parts = token.splitn(3, '_');
    let (Some(PREFIX), Some(key_id), Some(secret)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(AuthError::Malformed);
    };
    let id_ok = key_id.len() == 16 && key_id.bytes().all(|b| b.is_ascii_hexdigit());
    if !id_ok || secret.is_empty() {
        return Err(AuthError::Malformed);
    }
    Ok(PresentedKey {
        key_id: key_id.to_owned(),
        hash: hash_of(token),
    })
}

/// Whether the presented key is the stored one, compared in constant time.
pub fn matches(stored_hash: &str, presented: &PresentedKey) -> bool {
    stored_hash
        .as_bytes()
        .ct_eq(presented.hash.as_bytes())
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn an_issued_key_authenticates_and_only_its_hash_is_kept() {
        let key = issue(&mut StdRng::seed_from_u64(7));
        assert!(key.token.starts_with("rpd_"));
        assert!(
            !key.hash.contains(&key.token[20..]),
            "the hash is not the secret"
        );
        let header = format!("Bearer {}", key.token);
        let presented = parse_bearer(Some(header.as_bytes())).unwrap();
        assert_eq!(presented.key_id, key.key_id);
        assert!(matches(&key.hash, &presented));
        let other = issue(&mut StdRng::seed_from_u64(8));
        assert!(!matches(&other.hash, &presented));
    }

    #[test]
    fn a_tampered_key_fails_and_bad_headers_say_why() {
        let key = issue(&mut StdRng::seed_from_u64(1));
        let mut tampered = key.token.clone();
        let last = tampered.pop().unwrap();
        tampered.push(if last == 'A' { 'B' } else { 'A' });
        let presented = parse_bearer(Some(format!("Bearer {tampered}").as_bytes())).unwrap();
        assert!(!matches(&key.hash, &presented));

        assert_eq!(parse_bearer(None), Err(AuthError::Missing));
        assert_eq!(
            parse_bearer(Some(b"Basic dXNlcjpwYXNz")),
            Err(AuthError::NotBearer)
        );
        assert_eq!(parse_bearer(Some(b"Bearer")), Err(AuthError::NotBearer));
        assert_eq!(
            parse_bearer(Some(b"Bearer sk-live-123")),
            Err(AuthError::Malformed)
        );
        assert_eq!(
            parse_bearer(Some(b"Bearer rpd_nothex!nothex!_x")),
            Err(AuthError::Malformed)
        );
        assert_eq!(parse_bearer(Some(&[0xff, 0xfe])), Err(AuthError::NotBearer));
    }

    #[test]
    fn keys_are_distinct_and_carry_256_bits_of_secret() {
        let mut rng = StdRng::seed_from_u64(3);
        let a = issue(&mut rng);
        let b = issue(&mut rng);
        assert_ne!(a.key_id, b.key_id);
        assert_ne!(a.hash, b.hash);
        let secret = a.token.rsplit('_').next().unwrap();
        assert_eq!(URL_SAFE_NO_PAD.decode(secret).unwrap().len(), 32);
    }
}
