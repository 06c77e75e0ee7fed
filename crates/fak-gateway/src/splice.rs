//! Rewriting one tool result in a client's Anthropic request without touching any other
//! byte of it, for the `anthropic-upstream` engine (see
//! [`fak_engine::RawRequest`]): the upstream's prompt cache keys on the request's
//! bytes, so a re-serialized body (other key order, other whitespace, other escapes)
//! would miss the cache on every turn.
//!
//! **How the spans are found.** serde_json parses the body, with `&RawValue` fields
//! borrowing from it: `messages[i].content` and then, in a message with a rewrite, each
//! block of that content array. A borrowed `RawValue` is a slice of the input, so its
//! byte offset is its address minus the body's, checked to lie inside the body and to
//! hold the same text. The same parser that read the request for screening (serde_json
//! on the same bytes) locates the spans, so the two cannot disagree about which block is
//! which: duplicate keys, escaped key names and nesting are resolved the same way (a
//! duplicate `messages` or `content` is an error for both), and no hand-written scanner
//! has to get strings and escapes right.
//!
//! **The edit.** The `content` value of the block is replaced by the new content as a
//! JSON string (a block without `content` gets one, inserted before its closing brace),
//! so the bytes before and after that value are the client's. The result is parsed
//! again and each rewritten block checked to hold its new content; anything else is an
//! error, and the request fails rather than go upstream unscreened.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

/// The new `content` of one `tool_result` block: `messages[message].content[block]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Rewrite {
    /// Index into `messages`.
    pub message: usize,
    /// Index into that message's `content` blocks.
    pub block: usize,
    /// The text the block's `content` becomes (a stub).
    pub content: String,
}

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow)]
    messages: Vec<Msg<'a>>,
}

#[derive(Deserialize)]
struct Msg<'a> {
    #[serde(borrow)]
    content: &'a RawValue,
}

#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type")]
    kind: String,
    /// Present (even as `null`): its raw value.
    #[serde(default, borrow, deserialize_with = "present")]
    content: Option<&'a RawValue>,
}

/// A field that is present, whatever its value (`null` included).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(d).map(Some)
}

/// The byte offset of `part` in `base`, when `part` is a slice of it.
fn offset(base: &str, part: &str) -> Result<usize, String> {
    let at = (part.as_ptr() as usize)
        .checked_sub(base.as_ptr() as usize)
        .filter(|&at| at + part.len() <= base.len())
        .ok_or("a span lies outside the body")?;
    match base.get(at..at + part.len()) {
        Some(s) if s == part => Ok(at),
        _ => Err("a span does not match the body".into()),
    }
}

/// `body` with each rewrite's block content replaced (see the module docs); `body`
/// itself when there are none.
///
/// # Errors
/// A message naming what was wrong: the body is not UTF-8 JSON with a `messages` list,
/// a rewrite names a message or block that does not exist or is not a `tool_result`,
/// two rewrites name one block, or the result does not read back as intended.
pub(crate) fn rewrite_tool_results(body: &[u8], rewrites: &[Rewrite]) -> Result<Vec<u8>, String> {
    if rewrites.is_empty() {
        return Ok(body.to_vec());
    }
    let text = std::str::from_utf8(body).map_err(|e| format!("the body is not UTF-8: {e}"))?;
    let parsed: Body<'_> =
        serde_json::from_str(text).map_err(|e| format!("reading the body: {e}"))?;
    // (start, end, replacement) per rewrite.
    let mut edits: Vec<(usize, usize, String)> = Vec::with_capacity(rewrites.len());
    for r in rewrites {
        let at = format!("messages[{}].content[{}]", r.message, r.block);
        let msg = parsed
            .messages
            .get(r.message)
            .ok_or_else(|| format!("{at}: no such message"))?;
        let blocks: Vec<&RawValue> = serde_json::from_str(msg.content.get())
            .map_err(|e| format!("{at}: the content is not a list of blocks ({e})"))?;
        let raw = blocks
            .get(r.block)
            .ok_or_else(|| format!("{at}: no such block"))?;
        let block: Block<'_> = serde_json::from_str(raw.get()).map_err(|e| format!("{at}: {e}"))?;
        if block.kind != "tool_result" {
            return Err(format!(
                "{at} is a '{}' block, not a tool_result",
                block.kind
            ));
        }
        let value = serde_json::to_string(&r.content).map_err(|e| e.to_string())?;
        edits.push(match block.content {
            Some(c) => {
                let start = offset(text, c.get())?;
                (start, start + c.get().len(), value)
            }
            None => {
                // `raw` is the block's object, `{` ... `}`: the key goes before the `}`.
                let end = offset(text, raw.get())? + raw.get().len() - 1;
                (end, end, format!(", \"content\": {value}"))
            }
        });
    }
    edits.sort_by_key(|e| e.0);
    if edits
        .windows(2)
        .any(|w| w[1].0 < w[0].1 || w[1].0 == w[0].0)
    {
        return Err("two rewrites name the same block".into());
    }
    let mut out = Vec::with_capacity(body.len() + edits.iter().map(|e| e.2.len()).sum::<usize>());
    let mut from = 0;
    for (start, end, with) in &edits {
        out.extend_from_slice(&body[from..*start]);
        out.extend_from_slice(with.as_bytes());
        from = *end;
    }
    out.extend_from_slice(&body[from..]);
    // Read it back: every rewritten block holds its new content.
    let v: Value = serde_json::from_slice(&out).map_err(|e| format!("the rewritten body: {e}"))?;
    for r in rewrites {
        let got = v
            .pointer(&format!(
                "/messages/{}/content/{}/content",
                r.message, r.block
            ))
            .and_then(Value::as_str);
        if got != Some(r.content.as_str()) {
            return Err(format!(
                "the rewritten body does not hold the new content at messages[{}].content[{}]",
                r.message, r.block
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rw(message: usize, block: usize, content: &str) -> Rewrite {
        Rewrite {
            message,
            block,
            content: content.into(),
        }
    }

    #[test]
    fn only_the_content_value_changes() {
        let body = "{ \"model\":\"m\",\n  \"messages\" : [ {\"role\":\"user\",\"content\":\"hi\"},\n {\"content\": [ {\"type\":\"tool_result\", \"tool_use_id\":\"t1\",\"content\" :  \"bad \\\"stuff\\\" \\u00e9\" , \"is_error\":false}, {\"content\":[{\"type\":\"text\",\"text\":\"x\"}],\"type\":\"tool_result\",\"tool_use_id\":\"t2\"}], \"role\":\"user\"}], \"max_tokens\": 5}";
        let out = rewrite_tool_results(body.as_bytes(), &[rw(1, 0, "STUB \"q\"")]).unwrap();
        let out = String::from_utf8(out).unwrap();
        let old = "\"bad \\\"stuff\\\" \\u00e9\"";
        let at = body.find(old).unwrap();
        let new = "\"STUB \\\"q\\\"\"";
        assert_eq!(&out[..at], &body[..at]);
        assert_eq!(&out[at..at + new.len()], new);
        assert_eq!(&out[at + new.len()..], &body[at + old.len()..]);
        // An array content, and two rewrites at once.
        let out = rewrite_tool_results(body.as_bytes(), &[rw(1, 1, "S2"), rw(1, 0, "S1")]).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["messages"][1]["content"][0]["content"], "S1");
        assert_eq!(v["messages"][1]["content"][1]["content"], "S2");
        assert_eq!(v["messages"][1]["content"][1]["tool_use_id"], "t2");
        // No rewrites: the body itself.
        assert_eq!(
            rewrite_tool_results(body.as_bytes(), &[]).unwrap(),
            body.as_bytes()
        );
    }

    #[test]
    fn a_block_without_content_or_with_null_gets_one() {
        for body in [
            r#"{"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t" }]}]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":"tool_result","content":null,"tool_use_id":"t"}]}]}"#,
        ] {
            let out = rewrite_tool_results(body.as_bytes(), &[rw(0, 0, "S")]).unwrap();
            let v: Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(v["messages"][0]["content"][0]["content"], "S", "{body}");
            assert_eq!(v["messages"][0]["content"][0]["tool_use_id"], "t");
        }
    }

    #[test]
    fn bad_rewrites_and_bodies_are_errors() {
        let body = r#"{"messages":[{"role":"user","content":"hi"},{"role":"user","content":[{"type":"text","text":"x"}]}]}"#;
        for (r, says) in [
            (rw(0, 0, "S"), "not a list of blocks"),
            (rw(1, 0, "S"), "not a tool_result"),
            (rw(1, 5, "S"), "no such block"),
            (rw(9, 0, "S"), "no such message"),
        ] {
            let e = rewrite_tool_results(body.as_bytes(), &[r]).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
        let tr =
            r#"{"messages":[{"role":"user","content":[{"type":"tool_result","content":"a"}]}]}"#;
        let e = rewrite_tool_results(tr.as_bytes(), &[rw(0, 0, "S"), rw(0, 0, "T")]).unwrap_err();
        assert!(e.contains("same block"), "{e}");
        for bad in [
            &b"\xff"[..],
            b"{}",
            br#"{"messages": [], "messages": []}"#,
            br#"{"messages":[{"role":"user","content":[{"type":"tool_result","content":"a","content":"b"}]}]}"#,
        ] {
            assert!(rewrite_tool_results(bad, &[rw(0, 0, "S")]).is_err());
        }
    }
}
