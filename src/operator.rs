//! The operator's commands for tenants: `replyd workspace create`, `replyd api-key create`,
//! `replyd api-key revoke`. A new key is printed once, to standard output, and never again:
//! only its hash is stored.

use std::process::ExitCode;

use anyhow::Context;

use crate::api_key::issue;
use crate::cli::{ApiKeyCommand, WorkspaceCommand};
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
