//! The workspaces' end-user token signing secrets, as an API process verifies tokens with them:
//! opened from their sealed rows (`replyd_core::sealed`, under `api.end_user_token_key`) and
//! kept in memory, so a token's signature is checked before anything of it is read from the
//! database. A bearer that looks like a token but was not signed by a live secret (a forgery, a
//! guess, another deployment's) then costs no database read: only a signed token goes on to
//! its user's rate limit, and only then to the read of its user's and key's standing.
//!
//! The copy is the live secrets of every workspace, read at most every
//! [`REFRESH`] (so a rotation's retirement reaches every process within it), and read again on
//! a token naming a version it lacks (one made since: a workspace's first token, or the first
//! after a rotation), at most every [`MISS_REFRESH`], whatever a flood of forged versions asks.
//! A process that makes a secret keeps it at once, so its own tokens verify without a read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::Mutex;

use crate::store::{Store, StoreError};
use replyd_core::sealed::{SealingKey, signing_key_row};

/// How old the copy may be before a token's check reads it again.
pub const REFRESH: Duration = Duration::from_secs(10);
/// How soon after a read a token naming a version the copy lacks reads it again.
pub const MISS_REFRESH: Duration = Duration::from_millis(100);

/// An opened secret, and when a rotation retires it.
struct Opened {
    secret: Vec<u8>,
    retire_at: Option<DateTime<Utc>>,
}

#[derive(Default)]
struct Copy {
    read_at: Option<Instant>,
    secrets: HashMap<(String, i32), Opened>,
}

/// The secrets an API process verifies tokens with; `None` inside when tokens are off.
pub struct SigningKeys {
    key: Option<SealingKey>,
    // A tokio mutex: the read of the database is done under it, so one read serves every
    // token check waiting for it (no stampede when the copy goes stale).
    copy: Mutex<Copy>,
    reads: AtomicU64,
}

impl SigningKeys {
    /// Keys that open with `key`; with none, end-user tokens are off.
    pub fn new(key: Option<SealingKey>) -> Self {
        Self {
            key,
            copy: Mutex::new(Copy::default()),
            reads: AtomicU64::new(0),
        }
    }

    /// The sealing key, when end-user tokens are on.
    pub fn sealing(&self) -> Option<&SealingKey> {
        self.key.as_ref()
    }

    /// How often the copy was read from the database: what a flood of forged tokens costs it.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Keeps a secret this process just made or read for signing, so its tokens verify here
    /// without a read.
    pub async fn remember(&self, workspace: &str, version: i32, secret: Vec<u8>) {
        self.copy.lock().await.secrets.insert(
            (workspace.to_owned(), version),
            Opened {
                secret,
                retire_at: None,
            },
        );
    }

    /// The secret of `workspace`'s `version` if it verifies tokens now: `None` when there is
    /// no such live secret (or tokens are off).
    pub async fn secret(
        &self,
        store: &Store,
        workspace: &str,
        version: i32,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let Some(key) = &self.key else {
            return Ok(None);
        };
        let mut copy = self.copy.lock().await;
        let age = copy.read_at.map(|at| at.elapsed());
        let lacks = !copy.secrets.contains_key(&(workspace.to_owned(), version));
        let stale = age.is_none_or(|age| age >= REFRESH || (lacks && age >= MISS_REFRESH));
        if stale {
            self.reads.fetch_add(1, Ordering::Relaxed);
            let mut secrets = HashMap::new();
            for row in store.live_signing_keys().await? {
                let bound = signing_key_row(&row.workspace_id, row.version);
                match key.open(&row.sealed, &bound) {
                    Ok(secret) => {
                        secrets.insert(
                            (row.workspace_id, row.version),
                            Opened {
                                secret,
                                retire_at: row.retire_at,
                            },
                        );
                    }
                    Err(e) => crate::telemetry::signing_key_unopened(&row.workspace_id, &e),
                }
            }
            *copy = Copy {
                read_at: Some(Instant::now()),
                secrets,
            };
        }
        let now = Utc::now();
        Ok(copy
            .secrets
            .get(&(workspace.to_owned(), version))
            .filter(|o| o.retire_at.is_none_or(|at| at > now))
            .map(|o| o.secret.clone()))
    }
}
