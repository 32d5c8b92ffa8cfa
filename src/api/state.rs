//! What every handler reads ([`ApiState`]): the store, the API's settings, the bounds of new
//! work ([`IntakeLimits`]), the status changes the event streams follow, the quota policy and
//! the rate limiter, a bucket per caller (API key or end user).

use replyd_core::quota::{QuotaPolicy, QuotaSettings};

use super::settings::ApiSettings;
use crate::provider::ProviderSettings;
use crate::store::Store;
use crate::transport::kafka::settings::KafkaSettings;
use crate::worker::settings::WorkerSettings;

use super::changes::TaskChanges;
use super::rate_limit::KeyLimiter;
use super::signing::SigningKeys;

/// What bounds the work the API admits, from the worker's and Kafka's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntakeLimits {
    /// Attempt budget of API-created tasks (`worker.default_max_attempts`).
    pub max_attempts: u32,
    /// Largest message plus context (`worker.max_prompt_bytes`): a workers' limit, so the API
    /// refuses at once what the worker would dead-letter.
    pub max_prompt_bytes: usize,
    /// Largest Kafka record (`kafka.max_record_bytes`): the API refuses at once a task whose
    /// record the relay could never publish.
    pub max_record_bytes: usize,
    /// The model a request that names none is asked of (`provider.default_model`): what a
    /// workspace's model list judges it by.
    pub default_model: String,
}

impl IntakeLimits {
    pub fn of(worker: &WorkerSettings, kafka: &KafkaSettings, provider: &ProviderSettings) -> Self {
        Self {
            max_attempts: worker.default_max_attempts,
            max_prompt_bytes: worker.max_prompt_bytes,
            max_record_bytes: kafka.max_record_bytes,
            default_model: provider.default_model.clone(),
        }
    }
}

impl Default for IntakeLimits {
    /// The limits of the default settings.
    fn default() -> Self {
        Self::of(
            &WorkerSettings::default(),
            &KafkaSettings::default(),
            &ProviderSettings::default(),
        )
    }
}

/// What every handler reads.
#[derive(Clone)]
pub struct ApiState {
    pub store: Store,
    pub settings: ApiSettings,
    /// What bounds new work.
    pub limits: IntakeLimits,
    /// Task status changes, for the event streams.
    pub changes: TaskChanges,
    /// The quota policy (`[quota]`) new work is admitted under.
    pub quota: QuotaPolicy,
    /// The request rate per caller, API key or end user (`api.rate_limit_*`).
    pub limiter: std::sync::Arc<KeyLimiter>,
    /// The end users' token signing secrets (`api.end_user_token_key`).
    pub signing: std::sync::Arc<SigningKeys>,
    /// When this process last wrote each key's use (`replyd api-key list`).
    pub key_uses: std::sync::Arc<super::key_uses::KeyUses>,
}

impl ApiState {
    /// The state of `settings`, whose `validate()` already refused a sealing key that cannot
    /// be used (one that cannot is taken here as none: end-user tokens off).
    pub fn new(store: Store, settings: ApiSettings, limits: IntakeLimits) -> Self {
        Self {
            limiter: std::sync::Arc::new(KeyLimiter::new(&settings)),
            key_uses: std::sync::Arc::default(),
            signing: std::sync::Arc::new(SigningKeys::new(
                settings.sealing_key().and_then(Result::ok),
            )),
            store,
            settings,
            limits,
            changes: TaskChanges::default(),
            quota: QuotaSettings::default().policy(),
        }
    }
}
