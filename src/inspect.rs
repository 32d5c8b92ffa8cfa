//! `replyd inspect <task_id>`: a task's state, its attempts with outcomes and timings (and, for
//! a call that waited a second or more for the provider's capacity, what it waited behind), and
//! its saved reply, for operators.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::Context;

use crate::config::Settings;
use crate::store::Store;
use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{AttemptRecord, CapacityWait, StoredTask, TaskId, TokenUsage};

/// Exit code when the task does not exist.
pub const NO_SUCH_TASK: u8 = 4;

/// Runs `replyd inspect`: prints the task as text or JSON.
pub async fn run(settings: &Settings, task_id: &str, json: bool) -> anyhow::Result<ExitCode> {
    let id =
        TaskId::parse(task_id).with_context(|| format!("task id {task_id:?} is not a UUID"))?;
    let store = Store::connect(&settings.database)?;
    let Some(task) = store.read(id).await? else {
        eprintln!("replyd: no task {id}");
        return Ok(ExitCode::from(NO_SUCH_TASK));
    };
    let attempts = store.attempts(id).await?;
    if json {
        println!("{}", render_json(&task, &attempts));
    } else {
        print!("{}", render(&task, &attempts));
    }
    Ok(ExitCode::SUCCESS)
}

/// The task and its history as one JSON object.
pub fn render_json(task: &StoredTask, attempts: &[AttemptRecord]) -> serde_json::Value {
    serde_json::json!({
        "task_id": task.spec.task_id,
        "status": task.status.as_str(),
        "attempt_count": task.attempt_count,
        "max_attempts": task.spec.max_attempts,
        "refusals": task.refusals,
        "refusal_deadline": task.refusal_deadline,
        "deadline": task.spec.deadline,
        "assignment_version": task.assignment_version,
        "next_attempt_at": task.next_attempt_at,
        "last_error_class": task.last_error_class,
        "last_error": task.last_error,
        "provider_operation_id": task.provider_operation_id,
        "failure": task.failure,
        "saved_response": task.saved_response,
        "usage": TokenUsage::total_of(attempts.iter().map(|a| a.usage)),
        "attempts": attempts,
    })
}

/// Why an attempt's call waited for the provider's capacity (I9, I10): how long, and behind
/// what, as its worker saw it when the call joined the queue.
fn waited(wait: CapacityWait) -> String {
    let others = wait.calls_ahead - wait.own_ahead;
    let behind = if wait.calls_ahead == 0 {
        "with no call ahead of it: the capacity's pace".to_owned()
    } else {
        format!(
            "behind {} calls ({} of its own workspace's, {others} of {} other workspaces', \
             which took their turns with it)",
            wait.calls_ahead,
            wait.own_ahead,
            (wait.workspaces - 1).max(0)
        )
    };
    format!(
        " — waited {:.1}s for the provider's capacity, {behind}",
        f64::from(wait.waited_ms) / 1000.0
    )
}

/// Renders a task and its history as text.
pub fn render(task: &StoredTask, attempts: &[AttemptRecord]) -> String {
    let mut out = String::new();
    let spec = &task.spec;
    // Writing to a String cannot fail.
    let _ = writeln!(out, "task        {}", spec.task_id);
    let _ = writeln!(
        out,
        "workspace   {}  conversation {}  message {}  document {}",
        spec.workspace_id, spec.conversation_id, spec.message_id, spec.document_version
    );
    let _ = writeln!(out, "status      {}", task.status.as_str());
    let _ = writeln!(
        out,
        "attempts    {} of {}{}",
        task.attempt_count,
        spec.max_attempts,
        spec.deadline
            .map(|d| format!(", deadline {d}"))
            .unwrap_or_default()
    );
    if task.refusals > 0 {
        // Refusals spend no attempt (I7): shown apart, with the budget that bounds them.
        let _ = writeln!(
            out,
            "refusals    {} (no work done, no attempt spent){}",
            task.refusals,
            task.refusal_deadline
                .map(|d| format!(", none retried after {d}"))
                .unwrap_or_default()
        );
    }
    let _ = writeln!(out, "assignment  version {}", task.assignment_version);
    if let (Some(owner), Some(until)) = (&task.lease_owner, task.lease_until) {
        let _ = writeln!(out, "lease       {owner} until {until}");
    }
    if let Some(at) = task.next_attempt_at {
        let _ = writeln!(out, "next try    not before {at}");
    }
    if let Some(class) = &task.last_error_class {
        let _ = writeln!(
            out,
            "last error  {class}: {}",
            task.last_error.as_deref().unwrap_or("")
        );
    }
    if let Some(op) = &task.provider_operation_id {
        let _ = writeln!(out, "operation   {op}");
    }
    if let Some(failure) = &task.failure {
        let _ = writeln!(out, "failure     {failure}");
    }
    // Tokens as the provider reported them; "not reported" is never shown as 0.
    let unreported = attempts.iter().filter(|a| a.reported_nothing()).count();
    let _ = writeln!(
        out,
        "tokens      {}{}",
        TokenUsage::total_of(attempts.iter().map(|a| a.usage)).map_or_else(
            || "not reported".to_owned(),
            |u| format!(
                "{} prompt, {} completion",
                u.prompt_tokens, u.completion_tokens
            )
        ),
        if unreported > 0 {
            format!(" ({unreported} finished attempts reported none)")
        } else {
            String::new()
        }
    );
    let _ = writeln!(out, "created     {}", task.created_at);
    if let Some(at) = task.finished_at {
        let _ = writeln!(out, "finished    {at}");
    }
    let _ = writeln!(
        out,
        "\n#  version  worker                record        claimed                           took      tokens (prompt+completion)  outcome"
    );
    for a in attempts {
        let took = a
            .finished_at
            .map(|f| {
                format!(
                    "{:.3}s",
                    (f - a.claimed_at).num_milliseconds() as f64 / 1000.0
                )
            })
            .unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "{:<2} {:<8} {:<21} {:<13} {:<33} {:<9} {:<27} {}{}{}{}",
            a.attempt_no,
            a.assignment_version,
            a.worker,
            // The partition and offset of the record the claim was made for.
            a.source.map_or_else(
                || "-".to_owned(),
                |s| format!("{}@{}", s.partition, s.offset)
            ),
            a.claimed_at.to_string(),
            took,
            a.usage.map_or_else(
                || "not reported".to_owned(),
                |u| format!("{}+{}", u.prompt_tokens, u.completion_tokens)
            ),
            a.outcome.map_or("(open)", |o| o.as_str()),
            // A streamed answer that ended without a reply, and how much of it came.
            a.stream_end
                .map(|(end, chars)| format!(" (stream {}, {chars} chars)", end.as_str()))
                .unwrap_or_default(),
            a.detail
                .as_deref()
                .map(|d| format!(" — {d}"))
                .unwrap_or_default(),
            a.capacity_wait.map(waited).unwrap_or_default()
        );
    }
    match &task.saved_response {
        Some(reply) => {
            let _ = writeln!(out, "\nreply\n{reply}");
        }
        None => {
            let _ = writeln!(out, "\nreply       (none)");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_says_how_long_and_behind_whose_calls() {
        let wait = CapacityWait {
            waited_ms: 4_150,
            calls_ahead: 37,
            own_ahead: 5,
            workspaces: 3,
        };
        assert_eq!(
            waited(wait),
            " — waited 4.2s for the provider's capacity, behind 37 calls (5 of its own \
             workspace's, 32 of 2 other workspaces', which took their turns with it)"
        );
        let paced = CapacityWait {
            calls_ahead: 0,
            own_ahead: 0,
            workspaces: 1,
            ..wait
        };
        assert!(waited(paced).ends_with("with no call ahead of it: the capacity's pace"));
    }
}
