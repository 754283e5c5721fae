//! A turn's events as its Redis event list keeps them: without the `turn_id` member.
//!
//! Every `ack`, `tool_state`, `narration` and `final` of a turn carries the turn id
//! (49 bytes with its name: a third of a `tool_state`), and the list's key already names
//! the turn. So the Redis store (`store/redis.rs`) keeps each such event without it
//! ([`stored`]) and puts it back, in the same place, when the list is read ([`sent`]):
//! what a frontend is sent and what any reader of the store gets is the event as it was
//! encoded, byte for byte. Other events (an `error`, whose `turn_id` is optional) are
//! kept as they are.
//!
//! Pure: no I/O, no state.

use std::borrow::Cow;

/// The kinds of event whose `turn_id` is required and follows `type`.
const KINDS: [&str; 4] = ["ack", "tool_state", "narration", "final"];

/// The start of every event: its `type` member, first.
const TYPE: &str = r#"{"type":""#;

/// The name of the member left out.
const MEMBER: &str = r#","turn_id":"#;

/// Where the `type` member of `event` ends, when it is one of [`KINDS`].
fn after_kind(event: &str) -> Option<usize> {
    let rest = event.strip_prefix(TYPE)?;
    let kind = &rest[..rest.find('"')?];
    KINDS.contains(&kind).then_some(TYPE.len() + kind.len() + 1)
}

/// The `turn_id` member of `turn_id`, as an event encodes it.
fn member(turn_id: &str) -> String {
    // An id is a string, so encoding it cannot fail; a failure keeps events whole.
    let id = serde_json::to_string(turn_id).unwrap_or_default();
    format!("{MEMBER}{id}")
}

/// `event` of the turn `turn_id` as its event list keeps it: without its `turn_id`
/// member when that follows its `type`; otherwise as it is.
pub(crate) fn stored<'a>(event: &'a str, turn_id: &str) -> Cow<'a, str> {
    let Some(at) = after_kind(event) else {
        return Cow::Borrowed(event);
    };
    let member = member(turn_id);
    if !event[at..].starts_with(&member) || member.len() == MEMBER.len() {
        return Cow::Borrowed(event);
    }
    let mut kept = String::with_capacity(event.len() - member.len());
    kept.push_str(&event[..at]);
    kept.push_str(&event[at + member.len()..]);
    Cow::Owned(kept)
}

/// An event of the turn `turn_id` as read from its event list: with its `turn_id` put
/// back after its `type` when [`stored`] left it out.
pub(crate) fn sent(event: String, turn_id: &str) -> String {
    let Some(at) = after_kind(&event) else {
        return event;
    };
    if event[at..].starts_with(MEMBER) {
        return event;
    }
    let member = member(turn_id);
    let mut whole = String::with_capacity(event.len() + member.len());
    whole.push_str(&event[..at]);
    whole.push_str(&member);
    whole.push_str(&event[at..]);
    whole
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use toolfleet_common::{CallState, TurnEvent};

    use super::*;

    fn encoded(event: &TurnEvent) -> String {
        serde_json::to_string(event).expect("encodes")
    }

    #[test]
    fn an_event_read_back_is_the_event_stored_byte_for_byte() {
        let events = [
            TurnEvent::ToolState {
                turn_id: "t1".into(),
                tool_call_id: "c1".into(),
                name: "orders.status".into(),
                state: CallState::Running,
                error: None,
            },
            TurnEvent::Narration {
                turn_id: "t1".into(),
                text: "The turn_id is t1.".into(),
            },
        ];
        for event in &events {
            let whole = encoded(event);
            let kept = stored(&whole, "t1");
            assert!(!kept.contains(r#""turn_id""#), "{kept}");
            assert_eq!(kept.len(), whole.len() - r#","turn_id":"t1""#.len());
            assert_eq!(sent(kept.into_owned(), "t1"), whole);
        }
    }

    #[test]
    fn an_id_that_needs_escaping_round_trips() {
        let id = "t\"1\\";
        let whole = encoded(&TurnEvent::Narration {
            turn_id: id.into(),
            text: "x".into(),
        });
        let kept = stored(&whole, id);
        assert!(!kept.contains("turn_id"));
        assert_eq!(sent(kept.into_owned(), id), whole);
    }

    #[test]
    fn events_without_a_required_turn_id_are_kept_as_they_are() {
        let other_turn = encoded(&TurnEvent::Narration {
            turn_id: "t2".into(),
            text: "x".into(),
        });
        let error = json!({"type": "error", "error": {"code": "x"}}).to_string();
        let odd = json!({"s": "c1"}).to_string();
        let bare = json!({"type": "ack"}).to_string();
        for event in [&other_turn, &error, &odd] {
            assert!(matches!(stored(event, "t1"), Cow::Borrowed(_)), "{event}");
            assert_eq!(&sent(event.clone(), "t1"), event);
        }
        assert!(matches!(stored(&bare, "t1"), Cow::Borrowed(_)));
        assert!(matches!(stored(&other_turn, ""), Cow::Borrowed(_)));
    }
}
