//! Secrets sealed at rest: what the database keeps of each workspace's token signing secret.
//! A secret is sealed with AES-256-GCM under the deployment's key (`api.end_user_token_key`,
//! a setting that never enters the database), with what row it belongs to bound in as
//! associated data, so someone who reads the table, or moves a sealed secret to another row,
//! can neither sign a token nor have one verify. Pure: the nonce comes from the caller.
//!
//! The cipher is ring's, which the build already has for TLS and for signing tokens.

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};

/// Bytes of a sealing key.
pub const KEY_BYTES: usize = 32;

/// The deployment's sealing key.
pub struct SealingKey(LessSafeKey);

impl std::fmt::Debug for SealingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealingKey(***)")
    }
}

/// Why a sealed secret does not open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("the sealed secret is too short to hold a nonce and a tag")]
    Truncated,
    #[error(
        "the sealed secret does not open with this key (another key sealed it, or it belongs to another row)"
    )]
    WrongKeyOrRow,
}

impl SealingKey {
    /// The key from its setting: 32 bytes in base64 (standard or URL-safe, padded or not), as
    /// `openssl rand -base64 32` prints them. The error says what is wrong, never the value.
    pub fn parse(encoded: &str) -> Result<Self, String> {
        let encoded = encoded.trim();
        let bytes = STANDARD
            .decode(encoded)
            .or_else(|_| URL_SAFE_NO_PAD.decode(encoded.trim_end_matches('=')))
            .map_err(|_| "is not base64 (make one with `openssl rand -base64 32`)".to_owned())?;
        if bytes.len() != KEY_BYTES {
            return Err(format!(
                "holds {} bytes; it must hold {KEY_BYTES} (make one with `openssl rand -base64 32`)",
                bytes.len()
            ));
        }
        let key = UnboundKey::new(&AES_256_GCM, &bytes).map_err(|_| "is not an AES-256 key")?;
        Ok(Self(LessSafeKey::new(key)))
    }

    /// `secret` sealed for the row `bound_to` names, under `nonce` (random, never reused
    /// with this key: 96 random bits a seal keeps a collision out of reach).
    pub fn seal(&self, secret: &[u8], bound_to: &[u8], nonce: [u8; NONCE_LEN]) -> Vec<u8> {
        let mut out = secret.to_vec();
        self.0
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(bound_to),
                &mut out,
            )
            // Only a message past AES-GCM's 64 GiB bound fails; a secret is 32 bytes.
            .expect("a short secret always seals");
        let mut sealed = nonce.to_vec();
        sealed.extend_from_slice(&out);
        sealed
    }

    /// The secret `sealed` holds, if this key sealed it for the row `bound_to` names.
    pub fn open(&self, sealed: &[u8], bound_to: &[u8]) -> Result<Vec<u8>, SealError> {
        if sealed.len() < NONCE_LEN + AES_256_GCM.tag_len() {
            return Err(SealError::Truncated);
        }
        let (nonce, body) = sealed.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError::Truncated)?;
        let mut body = body.to_vec();
        let opened = self
            .0
            .open_in_place(nonce, Aad::from(bound_to), &mut body)
            .map_err(|_| SealError::WrongKeyOrRow)?;
        Ok(opened.to_vec())
    }
}

/// What a workspace's signing secret of `version` is bound to.
pub fn signing_key_row(workspace: &str, version: i32) -> Vec<u8> {
    format!("end_user_signing_keys/{workspace}/{version}").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

    #[test]
    fn a_sealed_secret_opens_only_with_its_key_and_for_its_row() {
        let key = SealingKey::parse(KEY).unwrap();
        let row = signing_key_row("acme", 1);
        let sealed = key.seal(b"the secret", &row, [7; NONCE_LEN]);
        assert!(!sealed.windows(10).any(|w| w == b"the secret"), "sealed");
        assert_eq!(key.open(&sealed, &row).unwrap(), b"the secret");
        assert_eq!(
            key.open(&sealed, &signing_key_row("acme", 2)),
            Err(SealError::WrongKeyOrRow),
            "another version's row"
        );
        assert_eq!(
            key.open(&sealed, &signing_key_row("other", 1)),
            Err(SealError::WrongKeyOrRow),
            "another workspace's row"
        );
        let other = SealingKey::parse(&STANDARD.encode([9u8; 32])).unwrap();
        assert_eq!(other.open(&sealed, &row), Err(SealError::WrongKeyOrRow));
        let mut tampered = sealed.clone();
        tampered[NONCE_LEN] ^= 1;
        assert_eq!(key.open(&tampered, &row), Err(SealError::WrongKeyOrRow));
        assert_eq!(key.open(&sealed[..20], &row), Err(SealError::Truncated));
    }

    #[test]
    fn a_key_setting_is_32_bytes_of_base64_and_its_error_shows_no_value() {
        assert!(SealingKey::parse(KEY).is_ok());
        assert!(SealingKey::parse(&URL_SAFE_NO_PAD.encode([1u8; 32])).is_ok());
        let short = SealingKey::parse(&STANDARD.encode([1u8; 16])).unwrap_err();
        assert!(short.contains("16 bytes"), "{short}");
        let bad = SealingKey::parse("not base64 at all!").unwrap_err();
        assert!(
            bad.contains("not base64") && !bad.contains("at all"),
            "{bad}"
        );
        assert_eq!(
            format!("{:?}", SealingKey::parse(KEY).unwrap()),
            "SealingKey(***)"
        );
    }
}
