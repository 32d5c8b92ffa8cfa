//! Workspaces and their API keys: made and revoked by operators, looked up on every API
//! request. Only a key's hash is stored (see `api_key`). A workspace's policy (its models,
//! output cap, system prompt and end users' `context`) is read on every new request.

use replyd_core::api_key::{IssuedKey, PresentedKey, matches};
use replyd_core::prompt_policy::EndUserContext;
use replyd_core::workspace_policy::WorkspacePolicy;

use super::{Store, StoreError};

/// What `create_workspace` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkspaceCreated {
    Created,
    /// It existed already; nothing changed.
    Exists,
}

/// What a presented API key is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyCheck {
    /// Live: its workspace.
    Live(String),
    /// Its holder's key, past its expiry (when).
    Expired(chrono::DateTime<chrono::Utc>),
    /// No live key matches: unknown, revoked, or a wrong secret.
    Unknown,
}

/// A key as `replyd api-key list` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ApiKeyListed {
    pub key_id: String,
    pub workspace_id: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
    pub last_used_at: Option<chrono::DateTime<chrono::Utc>>,
    pub revoked_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// What `revoke_api_key` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Revoked {
    Revoked {
        workspace_id: String,
    },
    /// Revoked before; the first revocation's time stands.
    AlreadyRevoked,
    NotFound,
}

/// Whether a workspace name is acceptable: lowercase letters, digits, `-` and `_`, starting
/// with a letter or digit, at most 63 characters (the table's check says the same).
pub fn valid_workspace_id(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && (bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit())
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-' || *b == b'_')
}

impl Store {
    pub async fn create_workspace(
        &self,
        workspace_id: &str,
    ) -> Result<WorkspaceCreated, StoreError> {
        let inserted = self
            .wrote_one_row(
                "INSERT INTO workspaces (workspace_id) VALUES ($1) ON CONFLICT DO NOTHING",
                &[&workspace_id],
            )
            .await?;
        Ok(if inserted {
            WorkspaceCreated::Created
        } else {
            WorkspaceCreated::Exists
        })
    }

    /// Stores a new key of `workspace_id`; `false` when there is no such workspace.
    pub async fn create_api_key(
        &self,
        workspace_id: &str,
        key: &IssuedKey,
    ) -> Result<bool, StoreError> {
        self.create_api_key_until(workspace_id, key, None).await
    }

    /// Stores `key` for the workspace, authenticating until `expires_at` (for good without
    /// one); false when there is no such workspace.
    pub async fn create_api_key_until(
        &self,
        workspace_id: &str,
        key: &IssuedKey,
        expires_at: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<bool, StoreError> {
        // One statement: the key is written only if the workspace exists.
        self.wrote_one_row(
            "INSERT INTO api_keys (key_id, workspace_id, key_hash, expires_at) \
             SELECT $1, workspace_id, $3, $4 FROM workspaces WHERE workspace_id = $2",
            &[&key.key_id, &workspace_id, &key.hash, &expires_at],
        )
        .await
    }

    /// Every key (of `workspace_id`, or of all), oldest first: what an operator may see of
    /// them, never a hash.
    pub async fn list_api_keys(
        &self,
        workspace_id: Option<&str>,
    ) -> Result<Vec<ApiKeyListed>, StoreError> {
        let rows = self
            .rows(
                "SELECT key_id, workspace_id, created_at, expires_at, last_used_at, revoked_at \
                 FROM api_keys WHERE $1::text IS NULL OR workspace_id = $1 \
                 ORDER BY created_at, key_id",
                &[&workspace_id],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| ApiKeyListed {
                key_id: r.get(0),
                workspace_id: r.get(1),
                created_at: r.get(2),
                expires_at: r.get(3),
                last_used_at: r.get(4),
                revoked_at: r.get(5),
            })
            .collect())
    }

    /// Notes that `key_id` was used now. Guarded, so that of the processes that note a key's
    /// use at once, one writes a minute.
    pub async fn note_api_key_use(&self, key_id: &str) -> Result<(), StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "UPDATE api_keys SET last_used_at = now() WHERE key_id = $1 \
                 AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')",
            )
            .await?;
        client.execute(&statement, &[&key_id]).await?;
        Ok(())
    }

    pub async fn revoke_api_key(&self, key_id: &str) -> Result<Revoked, StoreError> {
        let client = self.client().await?;
        // Guarded: only a live key is revoked, so the first revocation's time is kept.
        if let Some(row) = client
            .query_opt(
                "UPDATE api_keys SET revoked_at = clock_timestamp() \
                 WHERE key_id = $1 AND revoked_at IS NULL RETURNING workspace_id",
                &[&key_id],
            )
            .await?
        {
            return Ok(Revoked::Revoked {
                workspace_id: row.get(0),
            });
        }
        let exists = client
            .query_opt("SELECT 1 FROM api_keys WHERE key_id = $1", &[&key_id])
            .await?
            .is_some();
        Ok(if exists {
            Revoked::AlreadyRevoked
        } else {
            Revoked::NotFound
        })
    }

    /// The workspace of a live key that matches `presented`, or `None` (unknown, revoked or
    /// wrong secret: the caller answers all three alike).
    /// The workspace of a live key that matches `presented`; a key past its expiry is said to
    /// be so only when the presented key matches it (so only its holder learns it).
    pub async fn authenticate(&self, presented: &PresentedKey) -> Result<KeyCheck, StoreError> {
        let row = self
            .row_opt(
                "SELECT workspace_id, key_hash, \
                        CASE WHEN expires_at <= now() THEN expires_at END \
                 FROM api_keys WHERE key_id = $1 AND revoked_at IS NULL",
                &[&presented.key_id],
            )
            .await?;
        let Some(row) = row else {
            return Ok(KeyCheck::Unknown);
        };
        let hash: String = row.get(1);
        if !matches(&hash, presented) {
            return Ok(KeyCheck::Unknown);
        }
        Ok(
            match row.get::<_, Option<chrono::DateTime<chrono::Utc>>>(2) {
                Some(at) => KeyCheck::Expired(at),
                None => KeyCheck::Live(row.get(0)),
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_names_are_slugs() {
        for good in ["acme", "team-7", "a", "x_y", &"a".repeat(63)] {
            assert!(valid_workspace_id(good), "{good}");
        }
        for bad in [
            "",
            "Acme",
            "-acme",
            "acme corp",
            "ac/me",
            &"a".repeat(64),
            "é",
        ] {
            assert!(!valid_workspace_id(bad), "{bad}");
        }
    }
}

/// A change to a workspace's policy: `None` keeps a setting, `Some(None)` removes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyChange {
    pub allowed_models: Option<Option<Vec<String>>>,
    pub max_output_tokens: Option<Option<u32>>,
    pub system_prompt: Option<Option<String>>,
    pub end_user_context: Option<EndUserContext>,
}

impl Store {
    /// The rules `workspace_id`'s requests are judged by, with its token limit; None when
    /// there is no such workspace.
    pub async fn workspace_policy(
        &self,
        workspace_id: &str,
    ) -> Result<Option<WorkspacePolicy>, StoreError> {
        let row = self
            .row_opt(
                "SELECT w.allowed_models, w.max_output_tokens, q.token_limit, \
                 w.system_prompt, w.end_user_context_allowed \
                 FROM workspaces w LEFT JOIN quota_counters q USING (workspace_id) \
                 WHERE w.workspace_id = $1",
                &[&workspace_id],
            )
            .await?;
        Ok(row.map(|row| WorkspacePolicy {
            allowed_models: row.get("allowed_models"),
            max_output_tokens: row
                .get::<_, Option<i32>>("max_output_tokens")
                .and_then(|n| u32::try_from(n).ok()),
            token_limit: row.get("token_limit"),
            system_prompt: row.get("system_prompt"),
            end_user_context: if row.get("end_user_context_allowed") {
                EndUserContext::Allow
            } else {
                EndUserContext::Deny
            },
        }))
    }

    /// Applies `change` to `workspace_id`'s policy; `false` when there is no such workspace.
    pub async fn set_workspace_policy(
        &self,
        workspace_id: &str,
        change: &PolicyChange,
    ) -> Result<bool, StoreError> {
        let cap = change
            .max_output_tokens
            .map(|cap| cap.map(|n| i32::try_from(n).unwrap_or(i32::MAX)));
        self.wrote_one_row(
            "UPDATE workspaces SET \
             allowed_models = CASE WHEN $2 THEN $3 ELSE allowed_models END, \
             max_output_tokens = CASE WHEN $4 THEN $5 ELSE max_output_tokens END, \
             system_prompt = CASE WHEN $6 THEN $7 ELSE system_prompt END, \
             end_user_context_allowed = coalesce($8, end_user_context_allowed) \
             WHERE workspace_id = $1",
            &[
                &workspace_id,
                &change.allowed_models.is_some(),
                &change.allowed_models.clone().flatten(),
                &cap.is_some(),
                &cap.flatten(),
                &change.system_prompt.is_some(),
                &change.system_prompt.clone().flatten(),
                &change
                    .end_user_context
                    .map(|allowed| allowed == EndUserContext::Allow),
            ],
        )
        .await
    }
}

impl Store {
    /// Sets the workspace's weight (I10, 1 to 1,000; the table's check refuses others); whether
    /// the workspace exists.
    pub async fn set_workspace_weight(
        &self,
        workspace_id: &str,
        weight: i32,
    ) -> Result<bool, StoreError> {
        self.wrote_one_row(
            "UPDATE workspaces SET weight = $2 WHERE workspace_id = $1",
            &[&workspace_id, &weight],
        )
        .await
    }

    /// The workspace's weight, if it exists.
    pub async fn workspace_weight(&self, workspace_id: &str) -> Result<Option<i32>, StoreError> {
        let row = self
            .row_opt(
                "SELECT weight FROM workspaces WHERE workspace_id = $1",
                &[&workspace_id],
            )
            .await?;
        Ok(row.map(|row| row.get(0)))
    }

    /// The weights that are not the default of 1: few, so a worker reads them all.
    pub async fn workspace_weights(&self) -> Result<Vec<(String, i32)>, StoreError> {
        let rows = self
            .rows(
                "SELECT workspace_id, weight FROM workspaces WHERE weight <> 1",
                &[],
            )
            .await?;
        Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
    }
}
