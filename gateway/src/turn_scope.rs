//! Turn ids scoped by tenant: the id an HTTP client gives a turn (or the gateway gives
//! it) is the client's name for it within its tenant, never the id the fleet stores.
//!
//! Owns the mapping both ways: [`stored_turn_id`] derives the stored id from the tenant
//! and the client's id (so two tenants' `t1` are two turns, and no tenant can take,
//! read, cancel or probe another's id through the gateway), and [`ShownTurn`] writes the
//! client's id back into everything the client gets (events, the JSON answer, the cancel
//! reply, error messages). A turn id that is not the caller's tenant's answers exactly as
//! an id nobody used ([`unknown_turn`]). Never talks to the fleet.

use sha2::{Digest, Sha256};
use toolfleet_common::turn::{turn_codes, valid_turn_id};
use toolfleet_common::{CallError, TurnEvent};

use crate::error::ApiError;

/// Hex digits of the tenant's tag that starts every stored id of the tenant.
const TAG_HEX: usize = 12;
/// The longest turn id the fleet stores.
const MAX_TURN_ID: usize = 64;
/// The longest client id kept readable in the stored id (after the tag and `-`).
const READABLE: usize = MAX_TURN_ID - TAG_HEX - 1;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The id the fleet stores turn `client_id` of `tenant` under: the tenant's tag (12 hex
/// digits of a SHA-256 of the tenant), `-`, then the client's id when it fits in the 64
/// characters of a turn id, else 51 hex digits of a SHA-256 of the tenant and the id.
/// The same tenant and id always give the same stored id (a retry attaches to its turn),
/// other tenants never do. `client_id` must be a valid turn id ([`scope`] checks).
pub fn stored_turn_id(tenant: &str, client_id: &str) -> String {
    let digest = |parts: &[&[u8]]| {
        let mut sha = Sha256::new();
        for part in parts {
            sha.update((part.len() as u64).to_be_bytes());
            sha.update(part);
        }
        hex(&sha.finalize())
    };
    let tag = digest(&[b"toolfleet-http-tenant-v1", tenant.as_bytes()]);
    let tag = &tag[..TAG_HEX];
    if client_id.len() <= READABLE {
        return format!("{tag}-{client_id}");
    }
    let long = digest(&[
        b"toolfleet-http-turn-v1",
        tenant.as_bytes(),
        client_id.as_bytes(),
    ]);
    format!("{tag}-{}", &long[..READABLE])
}

/// A fresh client id for a turn submitted without one (32 hex digits, as the fleet
/// client draws them).
pub fn new_client_turn_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The refusal of a client turn id that is not 1–64 characters of `[A-Za-z0-9_-]`.
pub fn invalid_turn_id(client_id: &str) -> ApiError {
    ApiError::invalid_request(format!(
        "turn id {client_id:?} must be 1-64 characters of [A-Za-z0-9_-]"
    ))
}

/// The one answer to a turn id the caller's tenant has no turn under: never submitted,
/// past its retention, or another tenant's. The same status and bytes whatever the
/// reason, so the answer tells nothing about other tenants' ids.
pub fn unknown_turn() -> ApiError {
    ApiError::new(
        axum::http::StatusCode::NOT_FOUND,
        turn_codes::UNKNOWN_TURN,
        "no turn with this id is stored for this key's tenant (never submitted, or past its retention)",
    )
}

/// `client_id` of `tenant` with its stored id; 400 for an invalid id.
pub fn scope(tenant: &str, client_id: &str) -> Result<ShownTurn, ApiError> {
    if !valid_turn_id(client_id) {
        return Err(invalid_turn_id(client_id));
    }
    Ok(ShownTurn {
        stored: stored_turn_id(tenant, client_id),
        shown: client_id.to_string(),
    })
}

/// One turn's two ids: the one the fleet stores and the one its client uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShownTurn {
    /// The id the fleet stores the turn under.
    pub stored: String,
    /// The id the client named the turn with (or was given).
    pub shown: String,
}

impl ShownTurn {
    /// `event` as the client sees it: its `turn_id` the client's, and the stored id in
    /// an error's message replaced by it.
    pub fn show(&self, mut event: TurnEvent) -> TurnEvent {
        match &mut event {
            TurnEvent::Ack { turn_id, .. }
            | TurnEvent::ToolState { turn_id, .. }
            | TurnEvent::Narration { turn_id, .. } => self.replace(turn_id),
            TurnEvent::Final(fin) => self.replace(&mut fin.turn_id),
            TurnEvent::Error { turn_id, error } => {
                if let Some(turn_id) = turn_id {
                    self.replace(turn_id);
                }
                error.message = self.text(&error.message);
            }
        }
        event
    }

    /// `text` with the stored id written as the client's.
    pub fn text(&self, text: &str) -> String {
        text.replace(&self.stored, &self.shown)
    }

    /// `error` with the stored id written as the client's in its message.
    pub fn error(&self, error: impl Into<ApiError>) -> ApiError {
        let mut error = error.into();
        error.message = self.text(&error.message);
        error
    }

    /// The answer to a turn that ended with an `error` event carrying `error`; a turn
    /// the caller's tenant does not hold is [`unknown_turn`].
    pub fn refusal(&self, error: &CallError) -> ApiError {
        match error.code.as_str() {
            turn_codes::UNKNOWN_TURN | turn_codes::TENANT_NOT_ALLOWED => unknown_turn(),
            _ => self.error(ApiError::from_turn_error(error)),
        }
    }

    fn replace(&self, turn_id: &mut String) {
        if *turn_id == self.stored {
            turn_id.clone_from(&self.shown);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_ids_are_scoped_by_tenant_and_stable() {
        let acme = stored_turn_id("acme", "t1");
        assert_eq!(acme, stored_turn_id("acme", "t1"));
        assert_ne!(acme, stored_turn_id("globex", "t1"));
        assert_ne!(acme, stored_turn_id("acme", "t2"));
        assert!(acme.ends_with("-t1"), "{acme}");
        let longest = "x".repeat(64);
        for id in [
            "t1",
            &"y".repeat(READABLE),
            &"z".repeat(READABLE + 1),
            &longest,
        ] {
            for tenant in ["acme", "globex"] {
                let stored = stored_turn_id(tenant, id);
                assert!(valid_turn_id(&stored), "{stored}");
            }
        }
        assert_ne!(
            stored_turn_id("acme", &longest),
            stored_turn_id("globex", &longest)
        );
        // Another tenant's whole stored id, given as a client id, is still scoped.
        let squat = stored_turn_id("globex", &acme);
        assert_ne!(squat, acme);
        assert!(scope("acme", "a.b").is_err());
        assert!(scope("acme", &"x".repeat(65)).is_err());
    }

    #[test]
    fn events_show_the_clients_id() {
        let turn = scope("acme", "mine").unwrap_or_else(|_| ShownTurn {
            stored: String::new(),
            shown: String::new(),
        });
        let narration = TurnEvent::Narration {
            turn_id: turn.stored.clone(),
            text: "hi".into(),
        };
        assert_eq!(
            serde_json::to_value(turn.show(narration)).unwrap_or_default()["turn_id"],
            "mine"
        );
        let error = TurnEvent::Error {
            turn_id: Some(turn.stored.clone()),
            error: CallError::fatal("duplicate_turn", format!("turn {} exists", turn.stored)),
        };
        let shown = serde_json::to_string(&turn.show(error)).unwrap_or_default();
        assert!(!shown.contains(&turn.stored), "{shown}");
        assert!(shown.contains("turn mine exists"), "{shown}");
        let foreign = CallError::fatal(turn_codes::TENANT_NOT_ALLOWED, "another tenant's");
        let unknown = CallError::fatal(turn_codes::UNKNOWN_TURN, format!("no {}", turn.stored));
        let (a, b) = (turn.refusal(&foreign), turn.refusal(&unknown));
        assert_eq!((a.status, a.body()), (b.status, b.body()));
        assert_eq!(a.status, axum::http::StatusCode::NOT_FOUND);
    }
}
