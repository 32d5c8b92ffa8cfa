//! The sessions replyd opens to PostgreSQL: `database.url` read (its TLS half by [`super::tls`]),
//! the worker session settings added, and the pool every store operation checks a session out
//! of. Every error names where it tried to connect, never with the password.

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::error::StoreError;
use super::settings::DatabaseSettings;
use super::tls;

/// A pool of worker sessions and where it connects. Cheap to clone: the clones share the pool.
#[derive(Clone)]
pub struct Sessions {
    pool: Pool,
    /// Where the pool connects, for error messages (no credentials).
    target: String,
}

impl Sessions {
    /// Builds the pool. Connections are opened lazily, on first use.
    pub fn connect(settings: &DatabaseSettings) -> Result<Self, StoreError> {
        let config = session_config(settings)?;
        let manager = Manager::from_config(
            config,
            tls_connector(settings)?,
            ManagerConfig {
                // Fast recycling skips a round trip per checkout; a broken connection shows up
                // as an error on the next statement, which callers already handle.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size)
            .build()
            .map_err(|e| StoreError::Config(e.to_string()))?;
        Ok(Self {
            pool,
            target: target_of(settings),
        })
    }

    /// A pooled session. With fast recycling a checkout only fails when a new connection
    /// cannot be made, so every failure here says where it tried.
    pub async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => StoreError::Connect {
                target: self.target.clone(),
                reason: crate::telemetry::chain(&e),
            },
            other => StoreError::Pool(other),
        })
    }
}

/// Parses the URL and adds the worker session settings (`lock_timeout`,
/// `idle_in_transaction_session_timeout`, `statement_timeout`) to whatever `options` it has.
pub fn session_config(settings: &DatabaseSettings) -> Result<tokio_postgres::Config, StoreError> {
    let (mut config, tls) = parse_url(settings)?;
    tls.apply(&mut config);
    let mut options = config.get_options().unwrap_or_default().to_owned();
    options.push_str(&format!(
        " -c lock_timeout={} -c idle_in_transaction_session_timeout={} -c statement_timeout={}",
        settings.lock_timeout_ms,
        settings.idle_in_transaction_session_timeout_ms,
        settings.statement_timeout_ms
    ));
    config.options(options.trim());
    if config.get_application_name().is_none() {
        config.application_name("replyd");
    }
    Ok(config)
}

/// `database.url` as tokio-postgres's config and its TLS half. Neither error quotes the URL,
/// so no password leaks through them.
pub fn parse_url(
    settings: &DatabaseSettings,
) -> Result<(tokio_postgres::Config, tls::TlsSettings), StoreError> {
    let (rest, tls) = tls::split(settings.url.expose()).map_err(StoreError::Config)?;
    let config = rest.parse().map_err(|e: tokio_postgres::Error| {
        StoreError::Config(format!("not a PostgreSQL URL: {e}"))
    })?;
    Ok((config, tls))
}

/// The TLS connector `database.url`'s `sslmode` and `sslrootcert` ask for; every session
/// replyd opens (the pool, the listener, migrations, the checker) connects through it.
pub fn tls_connector(settings: &DatabaseSettings) -> Result<MakeRustlsConnect, StoreError> {
    let (_, tls) = parse_url(settings)?;
    tls::connector(&tls).map_err(StoreError::Config)
}

/// Where `settings.database.url` points, as `host:port[,host:port]/dbname`: for error
/// messages, so it never carries the user or the password.
pub fn target_of(settings: &DatabaseSettings) -> String {
    let Ok((config, _)) = parse_url(settings) else {
        return "an unparsable URL".into();
    };
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let host = match host {
                tokio_postgres::config::Host::Tcp(name) => name.clone(),
                tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
            };
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            format!("{host}:{port}")
        })
        .collect();
    let hosts = if hosts.is_empty() {
        "localhost:5432".to_owned()
    } else {
        hosts.join(",")
    };
    match config.get_dbname() {
        Some(db) => format!("{hosts}/{db}"),
        None => hosts,
    }
}

/// A connection error as [`StoreError::Connect`], naming the target. tokio-postgres puts the
/// cause both in its message and in its source; the chain keeps one copy.
pub fn connect_error(settings: &DatabaseSettings, error: &dyn std::error::Error) -> StoreError {
    StoreError::Connect {
        target: target_of(settings),
        reason: crate::telemetry::chain(error),
    }
}
