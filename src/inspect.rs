//! `replyd inspect <task_id>`: a task's state, its attempts with outcomes and timings, and its
//! saved reply, for operators.

use std::fmt::Write as _;

use crate::store::{AttemptRecord, StoredTask};

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
    let _ = writeln!(out, "created     {}", task.created_at);
    if let Some(at) = task.finished_at {
        let _ = writeln!(out, "finished    {at}");
    }
    let _ = writeln!(
        out,
        "\n#  version  worker                claimed                           took      outcome"
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
            "{:<2} {:<8} {:<21} {:<33} {:<9} {}{}",
            a.attempt_no,
            a.assignment_version,
            a.worker,
            a.claimed_at.to_string(),
            took,
            a.outcome.as_deref().unwrap_or("(open)"),
            a.detail
                .as_deref()
                .map(|d| format!(" — {d}"))
                .unwrap_or_default()
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
