//! # toolfleet-coordinator
//!
//! Takes turns from a queue group, validates each call, publishes one JetStream job per
//! call, joins the results in Redis under a deadline, narrates one answer and streams
//! `ack` → `tool_state` → `narration` → `final` back to the frontend. Replicas share the
//! load and can finish each other's turns.
//!
//! # A turn's path, one module per step
//!
//! | step | module | what happens there |
//! |---|---|---|
//! | 0 | `startup` | connections, streams, background tasks, drain |
//! | - | `replica` | `Replica`, the state every task shares, and the narrow handles it lends (`Outbox`, `JobSink`, `Sharing`); a leaf: it imports no handler |
//! | 1 | `intake` | the loop taking requests in; decode the request, check ids, parse the decision; the turn as named steps |
//! | - | `admission` | storing a new turn or replaying the stored one; its first events |
//! | - | `callers` | the submitting frontend: its own inbox as the only reply, its tenants |
//! | - | `log_sample` | `LogSample`: refusals a frontend triggers at will logged first and then once a period, with the count left out |
//! | 2 | `limits` | the turn's call cap, concurrency and deadline from config, tenant and request |
//! | 3 | [`validate`] | per-call verdicts: dispatch or refuse, with the refusal's code |
//! | 4 | `dispatch` | build the jobs, publish them (again with the same id when unconfirmed); hand back those that cannot be published |
//! | - | `sharing` | every job through its tool's lane, shared fairly between tenants; paced calls as slots release them; tenants' own limits (`overloaded`) |
//! | - | `lanes` | the lanes in Redis: a weighted fair queue per tool in front of its stream (Lua); tenants' turns in flight |
//! | 5 | `deadline` | the clock that ends owned turns at their deadlines; the sweeper for turns whose owner is gone |
//! | 6 | `results` | where results are joined: the shared results consumer records each result, reports its state, ends the turn on the last |
//! | 7 | `finalize` | `TurnEnd`: every way a turn ends, narrated and published once |
//! | - | `sent` | a stored `final` marked sent; the turn span exported from a stored turn |
//! | - | `events` | every event to a frontend and every notice between replicas |
//! | - | `event_log` | a turn's events as its Redis list keeps them: without the turn id each repeats |
//! | - | `trace` | the turn span from accept to `final` on whichever replica ends the turn |
//! | - | `memory` | Redis's memory sampled; new turns refused (`overloaded`) before it is full |
//! | - | `upkeep` | recreating lost streams and the results consumer; queue-lag and turn gauges |
//! | - | `turns` | the turns this replica owns and the per-turn publishing gate |
//! | - | `progress` | relaying `running`; forgetting turns another replica ended |
//! | - | `attach` | a frontend following a turn it submitted, from a `seq` |
//! | - | `cancel` | a frontend cancelling a turn it submitted; workers told to stop |
//! | - | [`store`] | `TurnStore`, the seam in front of the turn store; the Redis store (`store::redis`: Lua scripts, write-once results, end-once turns) and an in-memory store for unit tests |
//! | - | [`registry`] | the cached tool registry: definitions, schemas, live workers |
//! | - | [`narrate`] | the `Narrator` trait and the template narrator |
//! | - | `catalog` | serving the tool catalog to frontends |
//! | - | [`config`] | `CoordinatorConfig` (environment) and per-tenant policies |

mod admission;
mod attach;
mod callers;
mod cancel;
mod catalog;
pub mod config;
mod consumers;
mod deadline;
mod dispatch;
mod event_log;
mod events;
mod fault;
mod finalize;
mod finals;
mod intake;
mod lanes;
mod limits;
mod log_sample;
mod memory;
pub mod narrate;
mod progress;
pub mod registry;
mod replica;
mod results;
mod sent;
mod sharing;
mod startup;
pub mod store;
#[cfg(test)]
mod testing;
mod trace;
mod turns;
mod upkeep;
pub mod validate;

pub use config::{CoordinatorConfig, FrontendBindings, TenantPolicies, TenantPolicy};
pub use narrate::{Narrator, TemplateNarrator};
pub use startup::{run, run_with_narrator, REDIS_RESPONSE_TIMEOUT};
pub use store::TurnStore;

/// The Redis turn store under the name the integration tests import it by.
pub use store::redis as join;

/// Why a coordinator could not start.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// NATS could not be reached.
    #[error("nats: {0}")]
    Nats(#[from] async_nats::ConnectError),
    /// A subscription failed.
    #[error("subscribe: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
    /// The streams could not be created.
    #[error(transparent)]
    Streams(#[from] toolfleet_common::streams::EnsureStreamsError),
    /// The results consumer could not be created.
    #[error("results consumer: {0}")]
    Consumer(#[from] async_nats::jetstream::stream::ConsumerError),
    /// Redis could not be reached.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The HTTP endpoint could not bind.
    #[error("http endpoint: {0}")]
    Http(std::io::Error),
}
