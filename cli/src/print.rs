//! Rendering turn events for a terminal.
//!
//! Owns the human-readable layout of each event (`--json` prints them raw instead). It
//! must never decide anything from an event (failure, retries, exit status are the
//! caller's) and never write anywhere but standard output.

use std::time::Duration;

use toolfleet_common::TurnEvent;

/// Prints one event as a line (or a few).
pub fn event(event: &TurnEvent, at: Duration) {
    let ms = at.as_secs_f64() * 1000.0;
    match event {
        TurnEvent::Ack { text, calls, .. } => {
            println!("{ms:>8.1} ms  ack        {text}");
            for c in calls {
                println!("{:>11}  call       {} {}", "", c.tool_call_id, c.name);
            }
        }
        TurnEvent::ToolState {
            tool_call_id,
            name,
            state,
            error,
            ..
        } => {
            let detail = error
                .as_ref()
                .map(|e| format!("  [{}] {}", e.code, e.message))
                .unwrap_or_default();
            println!(
                "{ms:>8.1} ms  {:<10} {name} ({tool_call_id}){detail}",
                state.as_str()
            );
        }
        TurnEvent::Narration { text, .. } => println!("{ms:>8.1} ms  narration  {text}"),
        TurnEvent::Final(f) => {
            println!("{ms:>8.1} ms  final      {}", f.text);
            let s = f.summary;
            println!(
                "{:>11}  summary    total {}, ok {}, errors {}, timeouts {}, skipped {}{}",
                "",
                s.total,
                s.ok,
                s.errors,
                s.timeouts,
                s.skipped,
                if f.deadline_hit {
                    " (deadline hit)"
                } else {
                    ""
                }
            );
            for r in &f.results {
                let outcome = match (&r.error, r.ok) {
                    (_, true) => "ok".to_string(),
                    (Some(e), false) => format!("{} [{}]", r.state.as_str(), e.code),
                    (None, false) => r.state.as_str().to_string(),
                };
                println!(
                    "{:>11}  result     {} {} {outcome} in {} ms, attempt {}",
                    "", r.tool_call_id, r.name, r.duration_ms, r.attempts
                );
            }
        }
        TurnEvent::Error { error, .. } => {
            println!(
                "{ms:>8.1} ms  error      [{}] {}",
                error.code, error.message
            )
        }
    }
}
