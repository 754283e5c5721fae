//! Shutdown requests: every binary stops on SIGTERM or Ctrl-C through this module.
//!
//! Owns the signal handling of the coordinator, the worker and the CLI; it never decides
//! what stopping means (each `run` drains on its own when the token is cancelled).

use tokio_util::sync::CancellationToken;

/// Resolves at the first Ctrl-C (SIGINT) or, on Unix, SIGTERM.
pub async fn signalled() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// A token cancelled at the first shutdown signal; must be called inside a runtime.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        signalled().await;
        cancel.cancel();
    });
    token
}
