//! End users (V24, V27): each workspace's token signing secrets, sealed and versioned, each
//! user's token generation, and which end user a conversation belongs to. The tokens
//! themselves are `replyd_core::end_user`; the sealing, `replyd_core::sealed`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::RngCore as _;
use uuid::Uuid;

use replyd_core::end_user::{AskingKey, SECRET_BYTES};
use replyd_core::sealed::{SealingKey, signing_key_row};

use super::Store;
use super::error::StoreError;

/// A live signing secret of one workspace, still sealed.
#[derive(Debug, Clone)]
pub struct SealedSigningKey {
    pub workspace_id: String,
    pub version: i32,
    pub sealed: Vec<u8>,
    /// When a rotation retires it (tokens it signed stop verifying); none while current.
    pub retire_at: Option<DateTime<Utc>>,
}

/// Where a verified token's user and key stand now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenStanding {
    /// The user's generation: a token of another is revoked.
    pub generation: i64,
    /// Where the API key that asked for the token stands.
    pub key: AskingKey,
}

/// What a rotation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotated {
    /// Versions that will stop verifying at the overlap's end (already retiring sooner ones
    /// keep their earlier end).
    pub retiring: u64,
}

/// What a workspace signs its next token with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SigningKey {
    /// The current version and its secret.
    Current {
        version: i32,
        secret: Vec<u8>,
    },
    /// The current version does not open under the deployment's key (the key changed, or the
    /// row was written by something else): nothing is signed until a rotation retires it.
    Unopened {
        version: i32,
    },
    NoWorkspace,
}

/// Tries at making a workspace's first (or next) signing secret when others make one at once.
const SIGNING_TRIES: usize = 3;

impl Store {
    /// The workspace's current signing secret (its version and the secret), made when it has
    /// none live that is not retiring (its first token, or the first after a rotation; two
    /// first calls at once agree on one).
    pub async fn current_signing_key(
        &self,
        workspace: &str,
        key: &SealingKey,
    ) -> Result<SigningKey, StoreError> {
        let client = self.client().await?;
        for _ in 0..SIGNING_TRIES {
            let current = client
                .query_opt(
                    "SELECT version, sealed FROM end_user_signing_keys \
                     WHERE workspace_id = $1 AND retire_at IS NULL \
                     ORDER BY version DESC LIMIT 1",
                    &[&workspace],
                )
                .await?;
            if let Some(row) = current {
                let version: i32 = row.get(0);
                let sealed: Vec<u8> = row.get(1);
                return Ok(
                    match key.open(&sealed, &signing_key_row(workspace, version)) {
                        Ok(secret) => SigningKey::Current { version, secret },
                        Err(_) => SigningKey::Unopened { version },
                    },
                );
            }
            let next: Option<i32> = client
                .query_opt(
                    "SELECT coalesce((SELECT max(version) FROM end_user_signing_keys \
                                      WHERE workspace_id = $1), 0) + 1 \
                     FROM workspaces WHERE workspace_id = $1",
                    &[&workspace],
                )
                .await?
                .map(|row| row.get(0));
            let Some(version) = next else {
                return Ok(SigningKey::NoWorkspace);
            };
            let mut secret = [0u8; SECRET_BYTES];
            rand::rng().fill_bytes(&mut secret);
            let mut nonce = [0u8; 12];
            rand::rng().fill_bytes(&mut nonce);
            let sealed = key.seal(&secret, &signing_key_row(workspace, version), nonce);
            // The version's primary key decides between two first calls: the loser inserts
            // nothing and reads the winner's on the next round.
            client
                .execute(
                    "INSERT INTO end_user_signing_keys (workspace_id, version, sealed) \
                     VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
                    &[&workspace, &version, &sealed],
                )
                .await?;
        }
        Err(StoreError::Config(format!(
            "workspace {workspace}'s signing secret kept changing while it was made"
        )))
    }

    /// Every workspace's signing secrets that still verify tokens, sealed: what an API process
    /// keeps in memory, so a token's signature is checked before anything of it is read.
    pub async fn live_signing_keys(&self) -> Result<Vec<SealedSigningKey>, StoreError> {
        let rows = self
            .rows(
                "SELECT workspace_id, version, sealed, retire_at FROM end_user_signing_keys \
                 WHERE retire_at IS NULL OR retire_at > clock_timestamp()",
                &[],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|row| SealedSigningKey {
                workspace_id: row.get(0),
                version: row.get(1),
                sealed: row.get(2),
                retire_at: row.get(3),
            })
            .collect())
    }

    /// Where a verified token of `user`, asked for by the key `key_id`, stands now.
    pub async fn token_standing(
        &self,
        workspace: &str,
        user: &str,
        key_id: &str,
    ) -> Result<TokenStanding, StoreError> {
        let row = self
            .row(
                "SELECT coalesce((SELECT generation FROM end_users \
                                  WHERE workspace_id = $1 AND user_id = $2), 0), \
                        (SELECT CASE WHEN revoked_at IS NOT NULL THEN 'revoked' \
                                     WHEN expires_at <= now() THEN 'expired' \
                                     ELSE 'live' END \
                         FROM api_keys WHERE key_id = $3 AND workspace_id = $1)",
                &[&workspace, &user, &key_id],
            )
            .await?;
        Ok(TokenStanding {
            generation: row.get(0),
            // No such key of the workspace (a key is never deleted but with its workspace):
            // nothing vouches for the token.
            key: match row.get::<_, Option<&str>>(1) {
                Some("live") => AskingKey::Live,
                Some("expired") => AskingKey::Expired,
                _ => AskingKey::Revoked,
            },
        })
    }

    /// Rotates `workspace`'s signing secret: every version now live stops verifying tokens
    /// `overlap` from now (one retiring sooner keeps its end), and the next token is signed
    /// with a new version. `None` when the workspace does not exist.
    pub async fn rotate_signing_key(
        &self,
        workspace: &str,
        overlap: Duration,
    ) -> Result<Option<Rotated>, StoreError> {
        let client = self.client().await?;
        let exists = client
            .query_opt(
                "SELECT 1 FROM workspaces WHERE workspace_id = $1",
                &[&workspace],
            )
            .await?
            .is_some();
        if !exists {
            return Ok(None);
        }
        let retiring = client
            .execute(
                "UPDATE end_user_signing_keys \
                 SET retire_at = clock_timestamp() + make_interval(secs => $2) \
                 WHERE workspace_id = $1 AND (retire_at IS NULL \
                       OR retire_at > clock_timestamp() + make_interval(secs => $2))",
                &[&workspace, &overlap.as_secs_f64()],
            )
            .await?;
        Ok(Some(Rotated { retiring }))
    }

    /// Revokes every token of `user` issued so far; the user's new generation. Tokens asked
    /// for afterwards work.
    pub async fn revoke_end_user(&self, workspace: &str, user: &str) -> Result<i64, StoreError> {
        Ok(self
            .row(
                "INSERT INTO end_users (workspace_id, user_id, generation, revoked_at) \
                 VALUES ($1, $2, 1, clock_timestamp()) \
                 ON CONFLICT (workspace_id, user_id) DO UPDATE \
                 SET generation = end_users.generation + 1, revoked_at = clock_timestamp() \
                 RETURNING generation",
                &[&workspace, &user],
            )
            .await?
            .get(0))
    }

    /// Whose the conversation is: `None` when it has no row (no message of it was written
    /// through the API), `Some(None)` when it was begun with the workspace's key.
    pub async fn conversation_owner(
        &self,
        workspace: &str,
        conversation: &str,
    ) -> Result<Option<Option<String>>, StoreError> {
        let row = self
            .row_opt(
                "SELECT end_user_id FROM conversations \
                 WHERE workspace_id = $1 AND conversation_id = $2",
                &[&workspace, &conversation],
            )
            .await?;
        Ok(row.map(|row| row.get(0)))
    }

    /// Whose a task is, for an end user's request: its conversation's owner as
    /// [`Store::conversation_owner`] says, but only for a task whose message was written
    /// through the API in that conversation. A task a producer published as a record, or one
    /// whose message is not the conversation's, is the workspace's alone (`None`), whatever
    /// conversation row its id shares.
    pub async fn task_owner(
        &self,
        workspace: &str,
        conversation: &str,
        message_id: &str,
    ) -> Result<Option<Option<String>>, StoreError> {
        let Ok(message) = Uuid::parse_str(message_id) else {
            return Ok(None);
        };
        let row = self
            .row_opt(
                "SELECT c.end_user_id FROM conversations c \
                 WHERE c.workspace_id = $1 AND c.conversation_id = $2 \
                   AND EXISTS (SELECT 1 FROM messages m WHERE m.message_id = $3 \
                               AND m.workspace_id = $1 AND m.conversation_id = $2)",
                &[&workspace, &conversation, &message],
            )
            .await?;
        Ok(row.map(|row| row.get(0)))
    }

    /// The conversations `user` began, by id.
    pub async fn end_user_conversations(
        &self,
        workspace: &str,
        user: &str,
    ) -> Result<Vec<String>, StoreError> {
        let rows = self
            .rows(
                "SELECT conversation_id FROM conversations \
                 WHERE workspace_id = $1 AND end_user_id = $2 ORDER BY conversation_id",
                &[&workspace, &user],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}
