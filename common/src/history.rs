//! Rendering a turn's results as history the frontend appends to its session: OpenAI
//! `role: "tool"` messages and one Anthropic `user` message of `tool_result` blocks.
//!
//! The model must see exactly one result per call id it produced. Calls flattened out
//! of a `parallel` meta-call carry the meta-call's id as `parent_id`; the model only
//! knows that id, so their results are rendered together as one entry under it: the
//! aggregate `{"results": [...], "summary": {...}}`, each child with its timing
//! (`duration_ms`, `started_at`, `ended_at`) and the summary counting that meta-call's
//! children only, with the field names of the final event's [`Summary`].

use std::collections::HashMap;

use serde::ser::{SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::call::{codes, CallError, CallResult, CallState, Summary};

/// History ready to append to the frontend's session.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct History {
    /// OpenAI `role: "tool"` messages, one per call id the model produced.
    pub openai: Vec<Value>,
    /// One Anthropic `user` message whose `content` holds a `tool_result` block per
    /// call id the model produced.
    pub anthropic: Vec<Value>,
}

/// Renders `results` (in decision order) as ready-to-append history.
///
/// Results without a `parent_id` are one entry each. Results sharing a `parent_id`
/// become one entry under that id, at the position of the first of them, whose content
/// is the JSON object `{results, summary}`: `results` holds
/// `{tool_call_id, name, ok, result | error, duration_ms, started_at, ended_at}` per
/// child in order (timing as in the final event's results: `null` / `0` where the call
/// never ran), `summary` counts those children by state like [`Summary`]. The entry is
/// an error only when every one of them failed.
pub fn render_history(results: &[CallResult]) -> History {
    let entries = tool_entries(results);
    let mut openai = Vec::with_capacity(entries.len());
    let mut blocks = Vec::with_capacity(entries.len());
    for ToolEntry {
        id,
        content,
        is_error,
    } in &entries
    {
        openai.push(json!({
            "role": "tool",
            "tool_call_id": id,
            "content": content,
        }));
        blocks.push(json!({
            "type": "tool_result",
            "tool_use_id": id,
            "content": content,
            "is_error": is_error,
        }));
    }
    let anthropic = if blocks.is_empty() {
        Vec::new()
    } else {
        vec![json!({"role": "user", "content": blocks})]
    };
    History { openai, anthropic }
}

/// [`render_history`] of the results, serialized straight from them: the same JSON text
/// (members in the same order), without building its `Value` trees first. For writing a
/// `final`; [`render_history`] is for reading or changing the history.
pub struct HistoryOf<'a>(pub &'a [CallResult]);

impl Serialize for HistoryOf<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // Members in the order a `Value` object keeps them (sorted by name).
        #[derive(Serialize)]
        struct OpenAi<'a> {
            content: &'a str,
            role: &'static str,
            tool_call_id: &'a str,
        }
        #[derive(Serialize)]
        struct Block<'a> {
            content: &'a str,
            is_error: bool,
            tool_use_id: &'a str,
            #[serde(rename = "type")]
            kind: &'static str,
        }
        #[derive(Serialize)]
        struct User<'a> {
            content: Vec<Block<'a>>,
            role: &'static str,
        }
        let entries = tool_entries(self.0);
        let openai: Vec<OpenAi<'_>> = entries
            .iter()
            .map(|e| OpenAi {
                content: &e.content,
                role: "tool",
                tool_call_id: e.id,
            })
            .collect();
        let blocks: Vec<Block<'_>> = entries
            .iter()
            .map(|e| Block {
                content: &e.content,
                is_error: e.is_error,
                tool_use_id: e.id,
                kind: "tool_result",
            })
            .collect();
        let anthropic: Vec<User<'_>> = if blocks.is_empty() {
            Vec::new()
        } else {
            vec![User {
                content: blocks,
                role: "user",
            }]
        };
        let mut out = serializer.serialize_struct("History", 2)?;
        out.serialize_field("openai", &openai)?;
        out.serialize_field("anthropic", &anthropic)?;
        out.end()
    }
}

/// One history entry as the model sees it: the call id it made, the content, and
/// whether it failed.
struct ToolEntry<'a> {
    id: &'a str,
    content: String,
    is_error: bool,
}

/// The history entries of `results`, in order (see [`render_history`]).
fn tool_entries(results: &[CallResult]) -> Vec<ToolEntry<'_>> {
    group(results)
        .iter()
        .map(|entry| match entry {
            Entry::Single(result) => ToolEntry {
                id: result.tool_call_id.as_str(),
                content: result_content(result),
                is_error: !result.ok,
            },
            Entry::Group {
                parent_id,
                children,
            } => ToolEntry {
                id: parent_id,
                content: group_content(children),
                is_error: children.iter().all(|r| !r.ok),
            },
        })
        .collect()
}

/// The content the model sees for one call, as JSON text: the tool's result when the
/// call succeeded, otherwise `{"error": {"code", "message", "retryable"}, "state": ...}`.
pub fn result_content(result: &CallResult) -> String {
    if result.ok {
        return result.result.clone().unwrap_or(Value::Null).to_string();
    }
    json!({
        "error": error_value(result),
        "state": result.state.as_str(),
    })
    .to_string()
}

/// One history entry: a call the model made.
enum Entry<'a> {
    /// A call of the model's own.
    Single(&'a CallResult),
    /// The calls of one `parallel` meta-call, under the meta-call's id.
    Group {
        parent_id: &'a str,
        children: Vec<&'a CallResult>,
    },
}

fn group(results: &[CallResult]) -> Vec<Entry<'_>> {
    let mut entries = Vec::new();
    let mut groups: HashMap<&str, usize> = HashMap::new();
    for result in results {
        let Some(parent_id) = result.parent_id.as_deref() else {
            entries.push(Entry::Single(result));
            continue;
        };
        if let Some(Entry::Group { children, .. }) =
            groups.get(parent_id).and_then(|&i| entries.get_mut(i))
        {
            children.push(result);
            continue;
        }
        groups.insert(parent_id, entries.len());
        entries.push(Entry::Group {
            parent_id,
            children: vec![result],
        });
    }
    entries
}

/// The aggregate of one `parallel` meta-call: its children's results, with timing, and
/// their summary.
fn group_content(children: &[&CallResult]) -> String {
    let items: Vec<Value> = children
        .iter()
        .map(|child| {
            let mut item = Map::new();
            item.insert("tool_call_id".into(), child.tool_call_id.clone().into());
            item.insert("name".into(), child.name.clone().into());
            item.insert("ok".into(), child.ok.into());
            if child.ok {
                item.insert("result".into(), child.result.clone().unwrap_or(Value::Null));
            } else {
                item.insert("error".into(), error_value(child));
            }
            item.insert("duration_ms".into(), child.duration_ms.into());
            item.insert("started_at".into(), child.started_at.clone().into());
            item.insert("ended_at".into(), child.ended_at.clone().into());
            Value::Object(item)
        })
        .collect();
    let summary = serde_json::to_value(summary_of(children)).unwrap_or(Value::Null);
    json!({"results": items, "summary": summary}).to_string()
}

/// [`Summary::of`] over borrowed results: the same counts, without cloning them.
fn summary_of(children: &[&CallResult]) -> Summary {
    children.iter().fold(Summary::default(), |mut sum, child| {
        let one = Summary::of(std::slice::from_ref(*child));
        sum.total += one.total;
        sum.ok += one.ok;
        sum.errors += one.errors;
        sum.timeouts += one.timeouts;
        sum.skipped += one.skipped;
        sum.cancelled += one.cancelled;
        sum
    })
}

/// The error of a failed result, or one describing its state when it carries none.
fn error_value(result: &CallResult) -> Value {
    let error = result.error.clone().unwrap_or_else(|| {
        let (code, message) = match result.state {
            CallState::Timeout => (codes::DEADLINE_EXCEEDED, "the call timed out"),
            CallState::Skipped => (codes::NOT_DISPATCHED, "the call was not run"),
            CallState::Cancelled => (codes::CANCELLED, "cancelled by the caller"),
            _ => (codes::TOOL_ERROR, "the call failed"),
        };
        CallError::fatal(code, message)
    });
    json!({
        "code": error.code,
        "message": error.message,
        "retryable": error.retryable,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::call::ToolCall;

    fn call(id: &str, name: &str, parent: Option<&str>) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: json!({}),
            parent_id: parent.map(str::to_string),
        }
    }

    fn ok(id: &str, parent: Option<&str>, result: Value) -> CallResult {
        CallResult::success(&call(id, "tool", parent), result)
    }

    fn failed(id: &str, parent: Option<&str>) -> CallResult {
        CallResult::failure(
            &call(id, "tool", parent),
            CallState::Error,
            CallError::retryable(codes::TOOL_ERROR, "upstream 503"),
        )
    }

    /// `result` as a worker that ran it from `started` to `ended` reports it.
    fn timed(mut result: CallResult, started: &str, ended: &str, ms: u64) -> CallResult {
        result.started_at = Some(started.into());
        result.ended_at = Some(ended.into());
        result.duration_ms = ms;
        result.attempts = 1;
        result
    }

    fn timed_out(id: &str, parent: Option<&str>) -> CallResult {
        CallResult::failure(
            &call(id, "tool", parent),
            CallState::Timeout,
            CallError::retryable(
                codes::DEADLINE_EXCEEDED,
                "no result before the turn's deadline",
            ),
        )
    }

    /// The whole history expected for `entries` of `(id, content, is_error)`.
    fn expected(entries: &[(&str, String, bool)]) -> History {
        History {
            openai: entries
                .iter()
                .map(|(id, content, _)| {
                    json!({"role": "tool", "tool_call_id": id, "content": content})
                })
                .collect(),
            anthropic: vec![json!({"role": "user", "content": entries
                .iter()
                .map(|(id, content, is_error)| json!({
                    "type": "tool_result", "tool_use_id": id,
                    "content": content, "is_error": is_error,
                }))
                .collect::<Vec<_>>()})],
        }
    }

    fn parse(text: &Value) -> Value {
        text.as_str()
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or(Value::Null)
    }

    #[test]
    fn empty_results_render_nothing() {
        let h = render_history(&[]);
        assert!(h.openai.is_empty());
        assert!(h.anthropic.is_empty());
    }

    #[test]
    fn result_content_is_json_text() {
        assert_eq!(
            result_content(&ok("a", None, json!({"balance": 12.5}))),
            r#"{"balance":12.5}"#
        );
        assert_eq!(result_content(&ok("a", None, json!("hi"))), r#""hi""#);
        let mut no_value = ok("a", None, Value::Null);
        no_value.result = None;
        assert_eq!(result_content(&no_value), "null");
        let content: Value =
            serde_json::from_str(&result_content(&failed("b", None))).unwrap_or_default();
        assert_eq!(
            content,
            json!({"error": {"code": "tool_error", "message": "upstream 503", "retryable": true},
                   "state": "error"})
        );
    }

    #[test]
    fn failures_without_an_error_get_one() {
        let mut r = CallResult::failure(
            &call("t", "tool", None),
            CallState::Timeout,
            CallError::fatal("x", "y"),
        );
        r.error = None;
        let content: Value = serde_json::from_str(&result_content(&r)).unwrap_or_default();
        assert_eq!(content["error"]["code"], codes::DEADLINE_EXCEEDED);
        assert_eq!(content["state"], "timeout");
    }

    #[test]
    fn one_entry_per_call_in_order() {
        let results = [
            ok("a", None, json!(1)),
            failed("b", None),
            ok("c", None, json!(3)),
        ];
        let h = render_history(&results);
        assert_eq!(h.openai.len(), 3);
        assert_eq!(
            h.openai[0],
            json!({"role": "tool", "tool_call_id": "a", "content": "1"})
        );
        assert_eq!(h.openai[1]["tool_call_id"], "b");
        assert_eq!(h.openai[2]["content"], "3");

        assert_eq!(h.anthropic.len(), 1);
        assert_eq!(h.anthropic[0]["role"], "user");
        let blocks = h.anthropic[0]["content"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(blocks.len(), 3);
        assert_eq!(
            blocks[0],
            json!({"type": "tool_result", "tool_use_id": "a", "content": "1", "is_error": false})
        );
        assert_eq!(blocks[1]["tool_use_id"], "b");
        assert_eq!(blocks[1]["is_error"], true);
        assert_eq!(parse(&blocks[1]["content"])["error"]["code"], "tool_error");
        assert_eq!(blocks[2]["tool_use_id"], "c");
    }

    #[test]
    fn history_of_writes_the_rendered_history_text() {
        let sets: Vec<Vec<CallResult>> = vec![
            vec![],
            vec![ok(
                "a",
                None,
                json!({"balance": 12.5, "note": "quote \" and \u{e9} \\ \n"}),
            )],
            vec![
                ok("a", None, json!("hi")),
                failed("b", None),
                timed_out("c", None),
            ],
            vec![
                ok("p1", Some("par"), json!([1, 2])),
                ok("x", None, json!(null)),
                timed(failed("p2", Some("par")), "t0", "t1", 7),
                ok("p3", Some("other"), json!({"k": {"nested": true}})),
            ],
        ];
        for results in sets {
            let rendered = serde_json::to_string(&render_history(&results)).expect("encodes");
            let direct = serde_json::to_string(&HistoryOf(&results)).expect("encodes");
            assert_eq!(direct, rendered);
        }
    }

    #[test]
    fn parallel_children_become_one_entry_under_the_parent() {
        let results = [
            ok("first", None, json!("x")),
            ok("p.0", Some("p"), json!({"n": 1})),
            failed("p.1", Some("p")),
            ok("middle", None, json!(null)),
            ok("p.2", Some("p"), json!(true)),
            failed("q.0", Some("q")),
            failed("q.1", Some("q")),
        ];
        let h = render_history(&results);
        let ids: Vec<&str> = h
            .openai
            .iter()
            .filter_map(|m| m["tool_call_id"].as_str())
            .collect();
        assert_eq!(ids, ["first", "p", "middle", "q"]);

        let p = parse(&h.openai[1]["content"]);
        assert_eq!(
            p["results"],
            json!([
                {"tool_call_id": "p.0", "name": "tool", "ok": true, "result": {"n": 1},
                 "duration_ms": 0, "started_at": null, "ended_at": null},
                {"tool_call_id": "p.1", "name": "tool", "ok": false,
                 "error": {"code": "tool_error", "message": "upstream 503", "retryable": true},
                 "duration_ms": 0, "started_at": null, "ended_at": null},
                {"tool_call_id": "p.2", "name": "tool", "ok": true, "result": true,
                 "duration_ms": 0, "started_at": null, "ended_at": null},
            ])
        );

        let blocks = h.anthropic[0]["content"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(blocks.len(), 4);
        assert_eq!(blocks[1]["tool_use_id"], "p");
        assert_eq!(blocks[1]["is_error"], false);
        assert_eq!(blocks[3]["tool_use_id"], "q");
        assert_eq!(blocks[3]["is_error"], true);
        assert_eq!(blocks[1]["content"], h.openai[1]["content"]);
    }

    #[test]
    fn a_parallel_call_carries_its_summary_and_each_childs_timing() {
        let results = [
            timed(
                ok("call_par.0", Some("call_par"), json!({"n": 1})),
                "2026-01-20T14:00:00.010Z",
                "2026-01-20T14:00:00.017Z",
                7,
            ),
            timed(
                failed("call_par.1", Some("call_par")),
                "2026-01-20T14:00:00.011Z",
                "2026-01-20T14:00:00.013Z",
                2,
            ),
            timed_out("call_par.2", Some("call_par")),
        ];
        let content = concat!(
            r#"{"results":["#,
            r#"{"duration_ms":7,"ended_at":"2026-01-20T14:00:00.017Z","name":"tool","ok":true,"#,
            r#""result":{"n":1},"started_at":"2026-01-20T14:00:00.010Z","tool_call_id":"call_par.0"},"#,
            r#"{"duration_ms":2,"ended_at":"2026-01-20T14:00:00.013Z","#,
            r#""error":{"code":"tool_error","message":"upstream 503","retryable":true},"#,
            r#""name":"tool","ok":false,"started_at":"2026-01-20T14:00:00.011Z","tool_call_id":"call_par.1"},"#,
            r#"{"duration_ms":0,"ended_at":null,"#,
            r#""error":{"code":"deadline_exceeded","message":"no result before the turn's deadline","retryable":true},"#,
            r#""name":"tool","ok":false,"started_at":null,"tool_call_id":"call_par.2"}],"#,
            r#""summary":{"errors":1,"ok":1,"skipped":0,"timeouts":1,"total":3}}"#,
        );
        let h = render_history(&results);
        assert_eq!(h, expected(&[("call_par", content.to_string(), false)]));

        // The summary has the counts and the field names of the final event's summary.
        let summary: Summary =
            serde_json::from_value(parse(&h.openai[0]["content"])["summary"].clone())
                .unwrap_or_default();
        assert_eq!(summary, Summary::of(&results));
    }

    #[test]
    fn each_parallel_summary_counts_only_its_own_children() {
        let results = [
            ok("call_a.0", Some("call_a"), json!(1)),
            timed_out("call_a.1", Some("call_a")),
            ok("solo", None, json!("s")),
            failed("call_b.0", Some("call_b")),
            ok("call_a.2", Some("call_a"), json!(3)),
            failed("call_b.1", Some("call_b")),
        ];
        let never_ran = json!({"duration_ms": 0, "started_at": null, "ended_at": null});
        let child = |item: Value| {
            let mut item = item;
            if let (Some(item), Some(timing)) = (item.as_object_mut(), never_ran.as_object()) {
                item.extend(timing.clone());
            }
            item
        };
        let upstream = json!({"code": "tool_error", "message": "upstream 503", "retryable": true});
        let a = json!({
            "results": [
                child(json!({"tool_call_id": "call_a.0", "name": "tool", "ok": true, "result": 1})),
                child(json!({"tool_call_id": "call_a.1", "name": "tool", "ok": false,
                             "error": {"code": "deadline_exceeded",
                                       "message": "no result before the turn's deadline",
                                       "retryable": true}})),
                child(json!({"tool_call_id": "call_a.2", "name": "tool", "ok": true, "result": 3})),
            ],
            "summary": {"total": 3, "ok": 2, "errors": 0, "timeouts": 1, "skipped": 0},
        });
        let b = json!({
            "results": [
                child(json!({"tool_call_id": "call_b.0", "name": "tool", "ok": false,
                             "error": upstream})),
                child(json!({"tool_call_id": "call_b.1", "name": "tool", "ok": false,
                             "error": upstream})),
            ],
            "summary": {"total": 2, "ok": 0, "errors": 2, "timeouts": 0, "skipped": 0},
        });
        let h = render_history(&results);
        assert_eq!(
            h,
            expected(&[
                ("call_a", a.to_string(), false),
                ("solo", r#""s""#.to_string(), false),
                ("call_b", b.to_string(), true),
            ])
        );
    }

    #[test]
    fn a_decision_without_parallel_renders_as_before() {
        let results = [
            timed(
                ok("call_1", None, json!({"balance": 12.5})),
                "2026-01-20T14:00:00.010Z",
                "2026-01-20T14:00:00.017Z",
                7,
            ),
            failed("call_2", None),
            timed_out("call_3", None),
        ];
        let h = render_history(&results);
        assert_eq!(
            h,
            expected(&[
                ("call_1", r#"{"balance":12.5}"#.to_string(), false),
                (
                    "call_2",
                    r#"{"error":{"code":"tool_error","message":"upstream 503","retryable":true},"state":"error"}"#
                        .to_string(),
                    true,
                ),
                (
                    "call_3",
                    r#"{"error":{"code":"deadline_exceeded","message":"no result before the turn's deadline","retryable":true},"state":"timeout"}"#
                        .to_string(),
                    true,
                ),
            ])
        );
    }
}
