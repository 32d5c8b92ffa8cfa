//! What a problem's `detail` may repeat of what the caller sent: at most its first
//! [`ECHOED_CHARS`] characters, then `…` and its length, so an answer never grows with its
//! request (a 10 KB cursor once came back as a 10 KB body) and a caller can still tell which
//! of its values was refused. Every detail that names a caller's text goes through
//! [`quoted`] ([`quoted_bytes`] for a request head's bytes); the messages of the parsers the API uses (serde_json's, the query string's),
//! which quote the values they refuse, go through [`message`].

/// The characters of a caller's text a detail repeats.
pub const ECHOED_CHARS: usize = 64;

/// The most characters of a parser's message a detail repeats, its quoted parts already cut.
pub const MESSAGE_CHARS: usize = 512;

/// `text` quoted as a detail shows it (escaped, in double quotes): whole when it has at most
/// [`ECHOED_CHARS`] characters, else its start, `…`, and its length in bytes.
pub fn quoted(text: &str) -> String {
    match text.char_indices().nth(ECHOED_CHARS) {
        None => format!("{text:?}"),
        Some((cut, _)) => format!("{:?} ({} bytes)", format!("{}…", &text[..cut]), text.len()),
    }
}

/// Bytes a client sent that need not be UTF-8 (a request head's), quoted as a detail shows
/// them (ASCII-escaped): whole up to [`ECHOED_CHARS`] bytes, else their start, `…`, and their
/// length.
pub fn quoted_bytes(bytes: &[u8]) -> String {
    match bytes.get(..ECHOED_CHARS) {
        Some(cut) if cut.len() < bytes.len() => {
            format!("\"{}…\" ({} bytes)", cut.escape_ascii(), bytes.len())
        }
        _ => format!("\"{}\"", bytes.escape_ascii()),
    }
}

/// A parser's message with each part in double quotes or backticks (the values and field
/// names it repeats) cut to [`ECHOED_CHARS`] characters, `…` and the part's length, and the
/// whole to [`MESSAGE_CHARS`].
pub fn message(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(open) = rest.find(['"', '`']) {
        let delimiter = rest[open..].chars().next().unwrap_or('"');
        out.push_str(&rest[..=open]);
        let inner = &rest[open + 1..];
        let close = closing(inner, delimiter).unwrap_or(inner.len());
        let part = &inner[..close];
        match part.char_indices().nth(ECHOED_CHARS) {
            None => out.push_str(part),
            Some((cut, _)) => {
                out.push_str(&part[..cut]);
                out.push('…');
            }
        }
        let after = &inner[close..];
        if let Some(end) = after.chars().next() {
            out.push(end);
        }
        if part.chars().nth(ECHOED_CHARS).is_some() {
            out.push_str(&format!(" ({} bytes)", part.len()));
        }
        rest = after.get(delimiter.len_utf8()..).unwrap_or_default();
    }
    out.push_str(rest);
    match out.char_indices().nth(MESSAGE_CHARS) {
        None => out,
        Some((cut, _)) => format!("{}…", &out[..cut]),
    }
}

/// Where the part that `delimiter` opened ends in `text`: the next `delimiter` not escaped
/// by a backslash (serde quotes strings with Rust's escapes; backticks are not escaped).
fn closing(text: &str, delimiter: char) -> Option<usize> {
    let mut escaped = false;
    for (at, c) in text.char_indices() {
        match c {
            '\\' if delimiter == '"' && !escaped => escaped = true,
            c if c == delimiter && !escaped => return Some(at),
            _ => escaped = false,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_text_is_quoted_whole_and_a_long_one_by_its_start_and_length() {
        assert_eq!(quoted("conv-1"), r#""conv-1""#);
        assert_eq!(quoted("a\0b"), r#""a\0b""#);
        let at_bound = "é".repeat(ECHOED_CHARS);
        assert_eq!(quoted(&at_bound), format!("{at_bound:?}"));
        let long = "é".repeat(10_000);
        let shown = quoted(&long);
        assert_eq!(
            shown,
            format!("\"{}…\" (20000 bytes)", "é".repeat(ECHOED_CHARS))
        );
    }

    #[test]
    fn bytes_are_quoted_escaped_and_cut_as_text_is() {
        assert_eq!(quoted_bytes(b"x-key\x01"), r#""x-key\x01""#);
        let long = [b'a'; 100];
        assert_eq!(
            quoted_bytes(&long),
            format!("\"{}…\" (100 bytes)", "a".repeat(ECHOED_CHARS))
        );
    }

    #[test]
    fn a_parsers_message_keeps_its_words_and_cuts_what_it_quotes() {
        let long = "x".repeat(10_240);
        let typed = format!("invalid type: string \"{long}\", expected u32 at line 1 column 10290");
        assert_eq!(
            message(&typed),
            format!(
                "invalid type: string \"{}…\" (10240 bytes), expected u32 at line 1 column 10290",
                "x".repeat(ECHOED_CHARS)
            )
        );
        let unknown =
            format!("unknown field `{long}`, expected one of `conversation_id`, `message`");
        assert_eq!(
            message(&unknown),
            format!(
                "unknown field `{}…` (10240 bytes), expected one of `conversation_id`, `message`",
                "x".repeat(ECHOED_CHARS)
            )
        );
        // An escaped quote does not end the part; a part left open runs to the end.
        assert_eq!(message(r#"a "b\"c" d"#), r#"a "b\"c" d"#);
        let open = format!("value \"{long}");
        assert!(
            message(&open).ends_with("… (10240 bytes)"),
            "{}",
            message(&open)
        );
        assert_eq!(message("no quotes at all"), "no quotes at all");
    }

    #[test]
    fn a_parsers_message_is_cut_whole_past_its_bound() {
        let many = "`a` ".repeat(1_000);
        let cut = message(&many);
        assert_eq!(cut.chars().count(), MESSAGE_CHARS + 1);
        assert!(cut.ends_with('…'));
    }
}
