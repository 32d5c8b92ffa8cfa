//! The operator's commands for tenants: `replyd workspace create`, `replyd api-key create`,
//! `replyd api-key revoke`, `replyd quota set`, `replyd quota show`. A new key is printed once, to standard output, and never again:
//! only its hash is stored.

use std::process::ExitCode;

use anyhow::Context;

use crate::api_key::issue;
use crate::cli::{ApiKeyCommand, QuotaCommand, WorkspaceCommand};
use crate::config::Settings;
use crate::store::Store;
use crate::store::workspaces::{Revoked, WorkspaceCreated, valid_workspace_id};

/// Exit code when the named workspace or key does not exist.
pub const NOT_FOUND: u8 = 4;
/// Exit code of a name the workspace table refuses.
pub const BAD_NAME: u8 = 2;

pub async fn workspace(
    settings: &Settings,
    command: &WorkspaceCommand,
) -> anyhow::Result<ExitCode> {
    let WorkspaceCommand::Create { name } = command;
    if !valid_workspace_id(name) {
        eprintln!(
            "replyd: workspace name {name:?} is not valid: use 1 to 63 lowercase letters, digits, `-` or `_`, starting with a letter or digit"
        );
        return Ok(ExitCode::from(BAD_NAME));
    }
    let store = Store::connect(&settings.database)?;
    match store
        .create_workspace(name)
        .await
        .context("creating the workspace")?
    {
        WorkspaceCreated::Created => println!("workspace {name} created"),
        WorkspaceCreated::Exists => println!("workspace {name} exists already; nothing changed"),
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn api_key(settings: &Settings, command: &ApiKeyCommand) -> anyhow::Result<ExitCode> {
    let store = Store::connect(&settings.database)?;
    match command {
        ApiKeyCommand::Create { workspace } => {
            let key = issue(&mut rand::rng());
            if !store
                .create_api_key(workspace, &key)
                .await
                .context("storing the key")?
            {
                eprintln!(
                    "replyd: no workspace {workspace:?}: create it with `replyd workspace create`"
                );
                return Ok(ExitCode::from(NOT_FOUND));
            }
            println!("{}", key.token);
            eprintln!(
                "api key {} made for workspace {workspace}; it is shown only this once (only its hash is stored)",
                key.key_id
            );
        }
        ApiKeyCommand::Revoke { key_id } => match store.revoke_api_key(key_id).await? {
            Revoked::Revoked { workspace_id } => {
                println!("api key {key_id} of workspace {workspace_id} revoked")
            }
            Revoked::AlreadyRevoked => println!("api key {key_id} was revoked already"),
            Revoked::NotFound => {
                eprintln!("replyd: no api key {key_id:?}");
                return Ok(ExitCode::from(NOT_FOUND));
            }
        },
    }
    Ok(ExitCode::SUCCESS)
}

/// Parses `--limit`: a count of generations, or `none`.
fn parse_limit(text: &str) -> Result<Option<i64>, String> {
    if text.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    match text.parse::<i64>() {
        Ok(n) if n >= 0 => Ok(Some(n)),
        _ => Err(format!(
            "--limit {text:?} is not a number of generations (0 or more) or `none`"
        )),
    }
}

pub async fn quota(settings: &Settings, command: &QuotaCommand) -> anyhow::Result<ExitCode> {
    let store = Store::connect(&settings.database)?;
    match command {
        QuotaCommand::Set {
            workspace,
            limit,
            period,
        } => {
            let parsed = parse_limit(limit).and_then(|limit| {
                crate::quota::parse_period(period)
                    .map(|period| (limit, period))
                    .map_err(|e| format!("--period: {e}"))
            });
            let (limit, period) = match parsed {
                Ok(parsed) => parsed,
                Err(e) => {
                    eprintln!("replyd: {e}");
                    return Ok(ExitCode::from(BAD_NAME));
                }
            };
            // parse_period bounds the period to quota::MAX_PERIOD_SECONDS, far inside i64.
            let period_seconds = i64::try_from(period).unwrap_or(i64::MAX);
            if !store
                .set_quota(workspace, limit, period_seconds)
                .await
                .context("setting the quota")?
            {
                eprintln!("replyd: no workspace {workspace:?}");
                return Ok(ExitCode::from(NOT_FOUND));
            }
            let shown = limit.map_or_else(|| "no limit".to_owned(), |n| format!("{n} generations"));
            println!(
                "quota of workspace {workspace}: {shown} per {}",
                crate::quota::format_period(period)
            );
        }
        QuotaCommand::Show { workspace, json } => {
            let Some(state) = store.quota(workspace).await.context("reading the quota")? else {
                eprintln!("replyd: no workspace {workspace:?}");
                return Ok(ExitCode::from(NOT_FOUND));
            };
            let view = crate::api::quota::view(&state, settings.quota.policy());
            if *json {
                println!("{}", serde_json::to_string(&view)?);
            } else {
                let limit = view
                    .limit
                    .map_or_else(|| "none".to_owned(), |n| n.to_string());
                println!(
                    "workspace {workspace}: limit {limit} per {}, used {}, reserved {}, resets at {}",
                    view.period,
                    view.used,
                    view.reserved,
                    view.resets_at.to_rfc3339()
                );
                println!(
                    "policy: charge_failed={} pending_reserves={} reservation_ttl_ms={}",
                    view.policy.charge_failed,
                    view.policy.pending_reserves,
                    view.policy.reservation_ttl_ms
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_a_count_or_none() {
        assert_eq!(parse_limit("50"), Ok(Some(50)));
        assert_eq!(parse_limit("0"), Ok(Some(0)));
        assert_eq!(parse_limit("none"), Ok(None));
        for bad in ["-1", "ten", "", "1.5"] {
            assert!(parse_limit(bad).is_err(), "{bad:?}");
        }
    }
}
