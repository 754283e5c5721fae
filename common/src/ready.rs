//! Readiness of a fleet process: what `/readyz` checks for the coordinator and the
//! worker, written once.
//!
//! Owns the check itself (NATS connected, Redis answers `PING`, the named JetStream
//! streams and consumers exist); it never serves HTTP (`http` does) and never creates a
//! stream or consumer (`streams` and each process's start-up do).

use std::sync::Arc;

use crate::http::Readiness;

/// The JetStream objects a process needs before it is ready.
#[derive(Debug, Clone, Default)]
pub struct Needs {
    /// Streams that must exist.
    pub streams: Vec<String>,
    /// `(stream, consumer)` pairs that must exist.
    pub consumers: Vec<(String, String)>,
}

/// Ready when `nats` is connected, `redis` answers and every stream and consumer of
/// `needs` exists.
pub fn readiness(
    nats: async_nats::Client,
    js: async_nats::jetstream::Context,
    redis: crate::redis_client::RedisConnection,
    needs: Needs,
) -> Readiness {
    let needs = Arc::new(needs);
    Arc::new(move || {
        let (nats, js, mut redis, needs) =
            (nats.clone(), js.clone(), redis.clone(), Arc::clone(&needs));
        Box::pin(async move {
            if nats.connection_state() != async_nats::connection::State::Connected {
                return Err("NATS is not connected".into());
            }
            let pong: Result<String, _> = redis::cmd("PING").query_async(&mut redis).await;
            pong.map_err(|e| format!("Redis: {e}"))?;
            for stream in &needs.streams {
                js.get_stream(stream)
                    .await
                    .map_err(|e| format!("stream {stream}: {e}"))?;
            }
            for (stream, consumer) in &needs.consumers {
                js.get_stream(stream)
                    .await
                    .map_err(|e| format!("stream {stream}: {e}"))?
                    .consumer_info(consumer)
                    .await
                    .map_err(|e| format!("consumer {consumer}: {e}"))?;
            }
            Ok(())
        })
    })
}
