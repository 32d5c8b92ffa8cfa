//! The operator's commands for tenants: `replyd workspace create`, `replyd api-key create`,
//! `replyd api-key list`, `replyd api-key revoke`, `replyd quota set`, `replyd quota show`,
//! `replyd workspace policy` (models, output cap, system prompt, end users' `context`),
//! `replyd workspace retention`, `replyd workspace share` (its weight in the fair order, I10),
//! `replyd end-user-tokens rotate`. A new key is printed once, to
//! standard output, and never again: only its hash is stored.

use std::process::ExitCode;

use anyhow::Context;

use crate::cli::{ApiKeyCommand, EndUserTokensCommand, QuotaCommand, WorkspaceCommand};
use crate::config::Settings;
use crate::store::Store;
use crate::store::workspaces::{
    ApiKeyListed, PolicyChange, Revoked, WorkspaceCreated, valid_workspace_id,
};
use replyd_core::api_key::issue;

/// Exit code when the named workspace or key does not exist.
pub const NOT_FOUND: u8 = 4;
/// Exit code of a name the workspace table refuses.
pub const BAD_NAME: u8 = 2;

pub async fn workspace(
    settings: &Settings,
    command: &WorkspaceCommand,
) -> anyhow::Result<ExitCode> {
    let name = match command {
        WorkspaceCommand::Create { name } => name,
        WorkspaceCommand::Policy { .. } => return workspace_policy(settings, command).await,
        WorkspaceCommand::Retention { workspace, tasks } => {
            return workspace_retention(settings, workspace, tasks).await;
        }
        WorkspaceCommand::Share { workspace, weight } => {
            return workspace_share(settings, workspace, *weight).await;
        }
    };
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

async fn workspace_retention(
    settings: &Settings,
    workspace: &str,
    tasks: &str,
) -> anyhow::Result<ExitCode> {
    let seconds = if tasks.eq_ignore_ascii_case("none") {
        None
    } else {
        match replyd_core::quota::parse_period(tasks) {
            // parse_period bounds it to ten years, far inside i64.
            Ok(seconds) => Some(i64::try_from(seconds).unwrap_or(i64::MAX)),
            Err(e) => {
                eprintln!("replyd: --tasks: {e}");
                return Ok(ExitCode::from(BAD_NAME));
            }
        }
    };
    let store = Store::connect(&settings.database)?;
    if !store
        .set_task_retention(workspace, seconds)
        .await
        .context("setting the retention")?
    {
        eprintln!("replyd: no workspace {workspace:?}");
        return Ok(ExitCode::from(NOT_FOUND));
    }
    match seconds {
        Some(seconds) => println!(
            "workspace {workspace} keeps its finished tasks for {}",
            replyd_core::quota::format_period(seconds.max(1) as u64)
        ),
        None => {
            println!("workspace {workspace} keeps its finished tasks as retention.tasks_ms says")
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `replyd workspace share`: sets the weight when given, then shows it.
async fn workspace_share(
    settings: &Settings,
    workspace: &str,
    weight: Option<i32>,
) -> anyhow::Result<ExitCode> {
    let store = Store::connect(&settings.database)?;
    let found = match weight {
        Some(weight) => store
            .set_workspace_weight(workspace, weight)
            .await
            .context("setting the weight")?
            .then_some(weight),
        None => store
            .workspace_weight(workspace)
            .await
            .context("reading the weight")?,
    };
    let Some(weight) = found else {
        eprintln!("replyd: no workspace {workspace:?}");
        return Ok(ExitCode::from(NOT_FOUND));
    };
    println!("workspace {workspace} has weight {weight}");
    Ok(ExitCode::SUCCESS)
}

pub async fn api_key(settings: &Settings, command: &ApiKeyCommand) -> anyhow::Result<ExitCode> {
    let store = Store::connect(&settings.database)?;
    match command {
        ApiKeyCommand::Create {
            workspace,
            expires_in_days,
        } => {
            let key = issue(&mut rand::rng());
            let expires_at = expires_in_days
                .map(|days| chrono::Utc::now() + chrono::Duration::days(i64::from(days)));
            if !store
                .create_api_key_until(workspace, &key, expires_at)
                .await
                .context("storing the key")?
            {
                eprintln!(
                    "replyd: no workspace {workspace:?}: create it with `replyd workspace create`"
                );
                return Ok(ExitCode::from(NOT_FOUND));
            }
            println!("{}", key.token);
            let until = expires_at.map_or_else(
                || "until revoked".to_owned(),
                |at| {
                    format!(
                        "until {}",
                        at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                    )
                },
            );
            eprintln!(
                "api key {} made for workspace {workspace}, {until}; it is shown only this once (only its hash is stored)",
                key.key_id
            );
        }
        ApiKeyCommand::List { workspace, json } => {
            let keys = store
                .list_api_keys(workspace.as_deref())
                .await
                .context("reading the keys")?;
            if *json {
                for key in &keys {
                    println!("{}", serde_json::to_string(key)?);
                }
            } else {
                print!("{}", key_table(&keys, chrono::Utc::now()));
            }
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

pub async fn end_user_tokens(
    settings: &Settings,
    command: &EndUserTokensCommand,
) -> anyhow::Result<ExitCode> {
    let store = Store::connect(&settings.database)?;
    match command {
        EndUserTokensCommand::Rotate {
            workspace,
            overlap_seconds,
        } => {
            let overlap = std::time::Duration::from_secs(*overlap_seconds);
            let Some(rotated) = store
                .rotate_signing_key(workspace, overlap)
                .await
                .context("rotating the signing secret")?
            else {
                eprintln!("replyd: no workspace {workspace:?}");
                return Ok(ExitCode::from(NOT_FOUND));
            };
            println!(
                "workspace {workspace}: {} signing secret(s) retire in {overlap_seconds} s; the next token is signed with a new one",
                rotated.retiring
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn workspace_policy(
    settings: &Settings,
    command: &WorkspaceCommand,
) -> anyhow::Result<ExitCode> {
    let WorkspaceCommand::Policy {
        workspace,
        models,
        max_output_tokens,
        system_prompt,
        system_prompt_file,
        end_user_context,
    } = command
    else {
        unreachable!("called for `workspace policy` only");
    };
    let parsed = (|| {
        let models = models
            .as_deref()
            .map(replyd_core::workspace_policy::parse_models)
            .transpose()
            .map_err(|e| format!("--models: {e}"))?;
        let cap = max_output_tokens
            .as_deref()
            .map(
                |text| match parse_count(text, "--max-output-tokens", "output tokens")? {
                    None => Ok(None),
                    Some(n)
                        if (1..=i64::from(crate::api::reply_input::MAX_OUTPUT_TOKENS))
                            .contains(&n) =>
                    {
                        Ok(Some(n as u32))
                    }
                    Some(n) => Err(format!(
                        "--max-output-tokens {n} is not between 1 and {}",
                        crate::api::reply_input::MAX_OUTPUT_TOKENS
                    )),
                },
            )
            .transpose()?;
        let prompt_text = match (system_prompt, system_prompt_file) {
            (Some(text), _) => Some(text.clone()),
            (None, Some(path)) => Some(std::fs::read_to_string(path).map_err(|e| {
                format!("--system-prompt-file: cannot read {}: {e}", path.display())
            })?),
            (None, None) => None,
        };
        let prompt = prompt_text
            .as_deref()
            .map(|text| {
                replyd_core::prompt_policy::parse_system_prompt(
                    text,
                    settings.worker.max_prompt_bytes,
                )
            })
            .transpose()
            .map_err(|e| format!("--system-prompt: {e}"))?;
        let end_users = end_user_context
            .as_deref()
            .map(replyd_core::prompt_policy::EndUserContext::parse)
            .transpose()
            .map_err(|e| format!("--end-user-context: {e}"))?;
        Ok::<_, String>(PolicyChange {
            allowed_models: models,
            max_output_tokens: cap,
            system_prompt: prompt,
            end_user_context: end_users,
        })
    })();
    let change = match parsed {
        Ok(change) => change,
        Err(e) => {
            eprintln!("replyd: {e}");
            return Ok(ExitCode::from(BAD_NAME));
        }
    };
    let store = Store::connect(&settings.database)?;
    if change != PolicyChange::default()
        && !store
            .set_workspace_policy(workspace, &change)
            .await
            .context("setting the workspace's policy")?
    {
        eprintln!("replyd: no workspace {workspace:?}");
        return Ok(ExitCode::from(NOT_FOUND));
    }
    let Some(policy) = store
        .workspace_policy(workspace)
        .await
        .context("reading the workspace's policy")?
    else {
        eprintln!("replyd: no workspace {workspace:?}");
        return Ok(ExitCode::from(NOT_FOUND));
    };
    println!("workspace {workspace}: {}", describe_policy(&policy));
    Ok(ExitCode::SUCCESS)
}

/// A workspace's policy on one line; a long system prompt by its start and length (`quota
/// show --json` shows it whole).
fn describe_policy(policy: &replyd_core::workspace_policy::WorkspacePolicy) -> String {
    format!(
        "models {}, max_output_tokens {}, end_user_context {}, system_prompt {}",
        policy
            .allowed_models
            .as_ref()
            .map_or_else(|| "any".to_owned(), |m| m.join(",")),
        policy
            .max_output_tokens
            .map_or_else(|| "none".to_owned(), |n| n.to_string()),
        policy.end_user_context.as_str(),
        policy
            .system_prompt
            .as_deref()
            .map_or_else(|| "none".to_owned(), crate::api::echo::quoted)
    )
}

/// Parses a count given to `flag` (generations, tokens), or `none`.
fn parse_count(text: &str, flag: &str, what: &str) -> Result<Option<i64>, String> {
    if text.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    match text.parse::<i64>() {
        Ok(n) if n >= 0 => Ok(Some(n)),
        _ => Err(format!(
            "{flag} {text:?} is not a number of {what} (0 or more) or `none`"
        )),
    }
}

/// Parses `--end-user-share`: a percent from 1 to 100, or `none`.
fn parse_share(text: &str) -> Result<Option<i16>, String> {
    if text.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    match text.trim_end_matches('%').parse::<i16>() {
        Ok(n) if (1..=100).contains(&n) => Ok(Some(n)),
        _ => Err(format!(
            "--end-user-share {text:?} is not a percent from 1 to 100 or `none`"
        )),
    }
}

/// Parses `--limit`: a count of generations, or `none`.
fn parse_limit(text: &str) -> Result<Option<i64>, String> {
    parse_count(text, "--limit", "generations")
}

pub async fn quota(settings: &Settings, command: &QuotaCommand) -> anyhow::Result<ExitCode> {
    let store = Store::connect(&settings.database)?;
    match command {
        QuotaCommand::Set {
            workspace,
            limit,
            tokens,
            period,
            end_user_share,
        } => {
            if limit.is_none() && tokens.is_none() && period.is_none() && end_user_share.is_none() {
                eprintln!(
                    "replyd: nothing to set: give --limit, --tokens, --period or --end-user-share"
                );
                return Ok(ExitCode::from(BAD_NAME));
            }
            let share = match end_user_share.as_deref().map(parse_share).transpose() {
                Ok(share) => share,
                Err(e) => {
                    eprintln!("replyd: {e}");
                    return Ok(ExitCode::from(BAD_NAME));
                }
            };
            let parsed = (|| {
                let limit = limit.as_deref().map(parse_limit).transpose()?;
                let tokens = tokens
                    .as_deref()
                    .map(|t| parse_count(t, "--tokens", "tokens"))
                    .transpose()?;
                let period = period
                    .as_deref()
                    .map(replyd_core::quota::parse_period)
                    .transpose()
                    .map_err(|e| format!("--period: {e}"))?;
                Ok::<_, String>((limit, tokens, period))
            })();
            let (limit, tokens, period) = match parsed {
                Ok(parsed) => parsed,
                Err(e) => {
                    eprintln!("replyd: {e}");
                    return Ok(ExitCode::from(BAD_NAME));
                }
            };
            let Some(current) = store.quota(workspace).await.context("reading the quota")? else {
                eprintln!("replyd: no workspace {workspace:?}");
                return Ok(ExitCode::from(NOT_FOUND));
            };
            // parse_period bounds the period to quota::MAX_PERIOD_SECONDS, far inside i64.
            let period_seconds = period.map_or(current.period_seconds, |p| {
                i64::try_from(p).unwrap_or(i64::MAX)
            });
            let limit = limit.unwrap_or(current.usage.limit);
            let set = store
                .set_quota(workspace, limit, period_seconds)
                .await
                .context("setting the quota")?
                && match tokens {
                    Some(tokens) => store
                        .set_token_limit(workspace, tokens)
                        .await
                        .context("setting the token quota")?,
                    None => true,
                };
            let set = set
                && match share {
                    Some(share) => store
                        .set_end_user_share(workspace, share)
                        .await
                        .context("setting the end users' share")?,
                    None => true,
                };
            if !set {
                eprintln!("replyd: no workspace {workspace:?}");
                return Ok(ExitCode::from(NOT_FOUND));
            }
            let token_limit = match tokens {
                Some(tokens) => tokens,
                None => current.tokens.limit,
            };
            let shown = |n: Option<i64>, unit: &str| {
                n.map_or_else(|| format!("no limit of {unit}"), |n| format!("{n} {unit}"))
            };
            println!(
                "quota of workspace {workspace}: {} per {}, {}",
                shown(limit, "generations"),
                replyd_core::quota::format_period(period_seconds.max(1) as u64),
                shown(token_limit, "tokens")
            );
        }
        QuotaCommand::Show { workspace, json } => {
            let Some(state) = store.quota(workspace).await.context("reading the quota")? else {
                eprintln!("replyd: no workspace {workspace:?}");
                return Ok(ExitCode::from(NOT_FOUND));
            };
            let rules = store
                .workspace_policy(workspace)
                .await
                .context("reading the workspace's policy")?
                .unwrap_or_default();
            let view = crate::api::quota::view(&state, settings.quota.policy(), &rules);
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
                let token_limit = view
                    .tokens
                    .limit
                    .map_or_else(|| "none".to_owned(), |n| n.to_string());
                println!(
                    "tokens: limit {token_limit}, used {}, reserved {}",
                    view.tokens.used, view.tokens.reserved
                );
                println!("requests: {}", describe_policy(&rules));
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

/// `replyd api-key list`'s table: a key a line, its standing in words.
fn key_table(keys: &[ApiKeyListed], now: chrono::DateTime<chrono::Utc>) -> String {
    let time = |at: &chrono::DateTime<chrono::Utc>| at.format("%Y-%m-%d %H:%M").to_string();
    let mut out = format!(
        "{:<17} {:<24} {:<17} {:<17} {:<17} {}\n",
        "KEY", "WORKSPACE", "MADE", "EXPIRES", "LAST USED", "STATE"
    );
    for key in keys {
        let state = match (&key.revoked_at, &key.expires_at) {
            (Some(at), _) => format!("revoked {}", time(at)),
            (None, Some(at)) if *at <= now => "expired".to_owned(),
            _ => "live".to_owned(),
        };
        out.push_str(&format!(
            "{:<17} {:<24} {:<17} {:<17} {:<17} {}\n",
            key.key_id,
            key.workspace_id,
            time(&key.created_at),
            key.expires_at.as_ref().map_or("never".to_owned(), time),
            key.last_used_at.as_ref().map_or("never".to_owned(), time),
            state
        ));
    }
    out
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
