//! End users (V24): each workspace's token signing secret, each user's token generation, and
//! which end user a conversation belongs to. The tokens themselves are `replyd_core::end_user`.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rand::RngCore as _;

use replyd_core::end_user::SECRET_BYTES;
use replyd_core::secret::Secret;

use super::Store;
use super::error::StoreError;

/// What a token of a user is verified against.
pub struct TokenCheck {
    /// The workspace's signing secret (base64url), never shown.
    pub secret: Secret,
    /// The user's generation now: a token of another is revoked.
    pub generation: i64,
}

impl TokenCheck {
    /// The secret's bytes.
    pub fn key(&self) -> Vec<u8> {
        URL_SAFE_NO_PAD
            .decode(self.secret.expose())
            .unwrap_or_default()
    }
}

impl Store {
    /// The workspace's signing secret and the user's generation, for a new token; the secret
    /// is made on the first call (two first calls at once agree on one). `None` when the
    /// workspace does not exist.
    pub async fn token_signing(
        &self,
        workspace: &str,
        user: &str,
    ) -> Result<Option<TokenCheck>, StoreError> {
        let mut fresh = [0u8; SECRET_BYTES];
        rand::rng().fill_bytes(&mut fresh);
        let fresh = URL_SAFE_NO_PAD.encode(fresh);
        let client = self.client().await?;
        client
            .execute(
                "INSERT INTO end_user_token_secrets (workspace_id, secret) \
                 SELECT workspace_id, $2 FROM workspaces WHERE workspace_id = $1 \
                 ON CONFLICT DO NOTHING",
                &[&workspace, &fresh],
            )
            .await?;
        self.token_check(workspace, user).await
    }

    /// What a token of `user` in `workspace` is verified against: `None` when the workspace
    /// never signed one (or was erased).
    pub async fn token_check(
        &self,
        workspace: &str,
        user: &str,
    ) -> Result<Option<TokenCheck>, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "SELECT s.secret, coalesce(u.generation, 0) FROM end_user_token_secrets s \
                 LEFT JOIN end_users u ON u.workspace_id = s.workspace_id AND u.user_id = $2 \
                 WHERE s.workspace_id = $1",
            )
            .await?;
        let row = client.query_opt(&statement, &[&workspace, &user]).await?;
        Ok(row.map(|row| TokenCheck {
            secret: Secret::new(row.get::<_, String>(0)),
            generation: row.get(1),
        }))
    }

    /// Revokes every token of `user` issued so far; the user's new generation. Tokens asked
    /// for afterwards work.
    pub async fn revoke_end_user(&self, workspace: &str, user: &str) -> Result<i64, StoreError> {
        let client = self.client().await?;
        Ok(client
            .query_one(
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
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "SELECT end_user_id FROM conversations \
                 WHERE workspace_id = $1 AND conversation_id = $2",
            )
            .await?;
        let row = client
            .query_opt(&statement, &[&workspace, &conversation])
            .await?;
        Ok(row.map(|row| row.get(0)))
    }

    /// The conversations `user` began, by id.
    pub async fn end_user_conversations(
        &self,
        workspace: &str,
        user: &str,
    ) -> Result<Vec<String>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT conversation_id FROM conversations \
                 WHERE workspace_id = $1 AND end_user_id = $2 ORDER BY conversation_id",
                &[&workspace, &user],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}
