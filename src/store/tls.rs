//! TLS to PostgreSQL, as libpq's `sslmode` and `sslrootcert` describe it. tokio-postgres reads
//! only `disable`, `prefer` and `require` (and never verifies anything itself): replyd takes
//! both parameters out of `database.url` ([`split`], pure) and builds the rustls connector
//! that gives each mode libpq's meaning ([`connector`]):
//!
//! | `sslmode` | encrypted | chain verified | host name verified |
//! |---|---|---|---|
//! | `disable` | no | – | – |
//! | `prefer` (the default) | when the server offers it | no | no |
//! | `require` | yes | only when `sslrootcert` is given (as libpq does) | no |
//! | `verify-ca` | yes | yes | no |
//! | `verify-full` | yes | yes | yes |
//!
//! `sslrootcert` is a PEM file of trusted certificates, or `system` for the machine's store
//! (also what the verifying modes trust when it is not given).

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore};
use tokio_postgres_rustls::MakeRustlsConnect;

/// libpq's `sslmode`, all of it (`allow` aside: it only differs from `prefer` in the order of
/// attempts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    Disable,
    #[default]
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<Self, String> {
        Ok(match value {
            "disable" => Self::Disable,
            "prefer" | "allow" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode={other} is not one of disable, prefer, require, verify-ca, verify-full"
                ));
            }
        })
    }

    /// What tokio-postgres is told: whether TLS is attempted, and whether it is a must.
    fn negotiation(self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as Negotiation;
        match self {
            Self::Disable => Negotiation::Disable,
            Self::Prefer => Negotiation::Prefer,
            Self::Require | Self::VerifyCa | Self::VerifyFull => Negotiation::Require,
        }
    }
}

/// Where trusted certificates come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    /// A PEM file (`sslrootcert=/path/ca.pem`).
    File(PathBuf),
    /// The machine's store (`sslrootcert=system`, or nothing given).
    System,
}

/// The TLS half of `database.url`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsSettings {
    pub mode: SslMode,
    /// `sslrootcert`, when given.
    pub root_certs: Option<RootCerts>,
}

impl TlsSettings {
    /// The mode applied to a tokio-postgres config parsed from the rest of the URL.
    pub fn apply(&self, config: &mut tokio_postgres::Config) {
        config.ssl_mode(self.mode.negotiation());
    }
}

/// Takes `sslmode` and `sslrootcert` out of a connection string, a URL
/// (`postgres://…?sslmode=verify-full&sslrootcert=/etc/ca.pem`) or key=value pairs
/// (`host=db sslmode=verify-full`), and returns the rest, for tokio-postgres to parse.
pub fn split(url: &str) -> Result<(String, TlsSettings), String> {
    let mut tls = TlsSettings::default();
    let mut take = |key: &str, value: &str| -> Result<bool, String> {
        match key {
            "sslmode" => tls.mode = SslMode::parse(value)?,
            "sslrootcert" => {
                tls.root_certs = Some(match value {
                    "system" => RootCerts::System,
                    "" => return Err("sslrootcert is empty".into()),
                    path => RootCerts::File(PathBuf::from(path)),
                });
            }
            _ => return Ok(false),
        }
        Ok(true)
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            None => url.to_owned(),
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                    let value = percent_encoding::percent_decode_str(value)
                        .decode_utf8()
                        .map_err(|_| format!("{key} is not UTF-8 once decoded"))?;
                    if !take(key, &value)? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else {
        let mut kept = Vec::new();
        for word in url.split_whitespace() {
            let (key, value) = word.split_once('=').unwrap_or((word, ""));
            if !take(key, value.trim_matches('\''))? {
                kept.push(word);
            }
        }
        kept.join(" ")
    };
    Ok((rest, tls))
}

/// The connector for `tls`. Reads `sslrootcert` (so a missing or empty file is an error here,
/// at start-up, naming the file), never the network.
pub fn connector(tls: &TlsSettings) -> Result<MakeRustlsConnect, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let verifying = match tls.mode {
        SslMode::VerifyCa | SslMode::VerifyFull => true,
        SslMode::Require => tls.root_certs.is_some(),
        SslMode::Disable | SslMode::Prefer => false,
    };
    let chain = if verifying {
        let roots = Arc::new(root_store(
            tls.root_certs.as_ref().unwrap_or(&RootCerts::System),
        )?);
        Some(
            WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
                .build()
                .map_err(|e| format!("sslrootcert: {e}"))?,
        )
    } else {
        None
    };
    let verifier: Arc<dyn ServerCertVerifier> = match chain {
        Some(chain) if tls.mode == SslMode::VerifyFull => chain,
        chain => Arc::new(AnyHostName { chain, provider }),
    };
    let config = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

fn root_store(source: &RootCerts) -> Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    match source {
        RootCerts::File(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
            let (added, _) = store.add_parsable_certificates(certs);
            if added == 0 {
                return Err(format!(
                    "sslrootcert {}: no certificate in the file",
                    path.display()
                ));
            }
        }
        RootCerts::System => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(
                    "sslrootcert: the system's certificate store is empty; name a file".into(),
                );
            }
        }
    }
    Ok(store)
}

/// Every mode short of `verify-full`: the host name is never checked, the chain only when
/// there are roots to check it against (`verify-ca`, and `require` with `sslrootcert`).
/// Without them (`prefer`, and `require` alone) the certificate is taken as shown, as libpq
/// does. The handshake's signatures are always checked (as the chain's verifier checks them),
/// so the server must hold the key of the certificate it shows.
#[derive(Debug)]
struct AnyHostName {
    /// The verifier of the chain; none: any certificate is taken.
    chain: Option<Arc<WebPkiServerVerifier>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for AnyHostName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssl_parameters_are_taken_out_of_a_url_and_the_rest_is_kept() {
        let (rest, tls) = split(
            "postgres://u:p@db:5432/app?sslmode=verify-full&options=-c%20x%3D1&sslrootcert=%2Fetc%2Fca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u:p@db:5432/app?options=-c%20x%3D1");
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(
            tls.root_certs,
            Some(RootCerts::File(PathBuf::from("/etc/ca.pem")))
        );
    }

    #[test]
    fn a_url_without_parameters_prefers_tls_as_libpq_does() {
        let (rest, tls) = split("postgresql://u@db/app").unwrap();
        assert_eq!(rest, "postgresql://u@db/app");
        assert_eq!(tls, TlsSettings::default());
        assert_eq!(tls.mode, SslMode::Prefer);
        let (rest, tls) = split("postgres://u@db/app?sslmode=require").unwrap();
        assert_eq!(rest, "postgres://u@db/app");
        assert_eq!((tls.mode, tls.root_certs), (SslMode::Require, None));
    }

    #[test]
    fn key_value_strings_are_read_too() {
        let (rest, tls) =
            split("host=db user=u sslmode=verify-ca sslrootcert=system dbname=app").unwrap();
        assert_eq!(rest, "host=db user=u dbname=app");
        assert_eq!(
            (tls.mode, tls.root_certs),
            (SslMode::VerifyCa, Some(RootCerts::System))
        );
    }

    #[test]
    fn an_unknown_mode_or_an_empty_root_is_refused_by_name() {
        let error = split("postgres://db/app?sslmode=verify_full").unwrap_err();
        assert!(
            error.contains("sslmode=verify_full is not one of"),
            "{error}"
        );
        let error = split("postgres://db/app?sslrootcert=").unwrap_err();
        assert!(error.contains("sslrootcert is empty"), "{error}");
    }

    #[test]
    fn tokio_postgres_is_told_to_insist_on_tls_for_every_mode_that_needs_it() {
        use tokio_postgres::config::SslMode as N;
        let negotiated = |mode: SslMode| {
            let mut config = tokio_postgres::Config::new();
            TlsSettings {
                mode,
                root_certs: None,
            }
            .apply(&mut config);
            config.get_ssl_mode()
        };
        assert_eq!(negotiated(SslMode::Disable), N::Disable);
        assert_eq!(negotiated(SslMode::Prefer), N::Prefer);
        for mode in [SslMode::Require, SslMode::VerifyCa, SslMode::VerifyFull] {
            assert_eq!(negotiated(mode), N::Require, "{mode:?}");
        }
    }

    #[test]
    fn a_root_file_that_is_missing_or_holds_no_certificate_is_named() {
        let tls = |path: &str| TlsSettings {
            mode: SslMode::VerifyFull,
            root_certs: Some(RootCerts::File(PathBuf::from(path))),
        };
        let error = connector(&tls("/nonexistent/ca.pem")).err().unwrap();
        assert!(error.contains("sslrootcert /nonexistent/ca.pem"), "{error}");
        let empty = std::env::temp_dir().join(format!("replyd-empty-{}.pem", std::process::id()));
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let error = connector(&tls(empty.to_str().unwrap())).err().unwrap();
        assert!(error.contains("no certificate in the file"), "{error}");
        std::fs::remove_file(empty).unwrap();
    }
}
