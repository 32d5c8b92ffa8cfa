//! What a workspace may ask for, the pure rules: the models it may name and the most output
//! tokens a request may ask for (both set by an operator, `replyd workspace policy`), and the
//! token ceiling its quota reservation holds. Its rules for the system turn (its own prompt,
//! its end users' `context`) are in [`crate::prompt_policy`].
//!
//! A request is judged before it is written: a model outside the list, or `max_output_tokens`
//! over the cap, is a `422` naming the field and the workspace's setting. A request that names
//! no `max_output_tokens` under a cap asks for the cap: the provider is then told the bound
//! the reservation assumes, so the ceiling is one the provider keeps to.

use serde::{Deserialize, Serialize};

/// Whether a workspace's end users may send `context` with their tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EndUserContext {
    /// A token's `context` is refused: the system turn is the workspace's alone.
    #[default]
    Deny,
    /// A token may send `context`, after the workspace's prompt.
    Allow,
}

impl EndUserContext {
    /// As the operator writes it and the read-outs show it.
    pub fn as_str(self) -> &'static str {
        match self {
            EndUserContext::Deny => "deny",
            EndUserContext::Allow => "allow",
        }
    }

    /// The operator's `allow` or `deny`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text.trim() {
            "allow" => Ok(EndUserContext::Allow),
            "deny" => Ok(EndUserContext::Deny),
            other => Err(format!("`{other}` is not `allow` or `deny`")),
        }
    }
}

/// An operator's rules for one workspace's requests.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspacePolicy {
    /// None: any model. Otherwise the models a request may name, or its default resolve to.
    pub allowed_models: Option<Vec<String>>,
    /// None: no cap beyond the API's own bound.
    pub max_output_tokens: Option<u32>,
    /// The workspace's quota in tokens per period; None: no limit.
    pub token_limit: Option<i64>,
    /// The system prompt every task of the workspace is asked with
    /// ([`crate::prompt_policy`]); None: none.
    pub system_prompt: Option<String>,
    /// Whether its end users' tokens may send `context`.
    pub end_user_context: EndUserContext,
}

/// A request the policy admits: what it asks the provider for, and what its reservation holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    /// The bound the task asks the provider for: the request's own, else the workspace's cap,
    /// else none (the provider's default).
    pub max_output_tokens: Option<u32>,
    /// Tokens the reservation holds until the reply's usage is known ([`token_ceiling`]).
    pub token_ceiling: i64,
}

/// Why the policy refuses a request: the fields at fault, and what is wrong with them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyRefusal {
    pub fields: Vec<&'static str>,
    pub detail: String,
}

/// Tokens a chat request's framing adds beyond its text (role markers and separators). OpenAI's
/// and Anthropic's chat formats add 3 to 4 a message; 8 stays above both.
pub const FRAMING_TOKENS_PER_MESSAGE: i64 = 8;

/// The output a reservation holds for a request with no `max_output_tokens` in a workspace with
/// no cap. Nothing bounds that reply at the provider, so its settlement charges what it
/// reports even above this; a workspace whose token quota must hold sets a cap.
pub const DEFAULT_OUTPUT_CEILING: i64 = 4_096;

/// The most tokens a request may cost: its prompt's bytes (a tokenizer's token is at least one
/// byte of UTF-8, so no prompt has more tokens than bytes), its framing, and its output bound.
pub fn token_ceiling(prompt_parts: &[usize], max_output_tokens: Option<u32>) -> i64 {
    let prompt: i64 = prompt_parts
        .iter()
        .map(|bytes| i64::try_from(*bytes).unwrap_or(i64::MAX) + FRAMING_TOKENS_PER_MESSAGE)
        .fold(0, i64::saturating_add);
    prompt.saturating_add(max_output_tokens.map_or(DEFAULT_OUTPUT_CEILING, i64::from))
}

/// Judges a request against `policy`: `model` as the request names it (None: `default_model`),
/// its `max_output_tokens`, and the byte lengths of the messages it sends.
pub fn judge(
    policy: &WorkspacePolicy,
    model: Option<&str>,
    default_model: &str,
    max_output_tokens: Option<u32>,
    prompt_parts: &[usize],
) -> Result<Admitted, PolicyRefusal> {
    if let Some(allowed) = &policy.allowed_models {
        let asked = model.unwrap_or(default_model);
        if !allowed.iter().any(|m| m == asked) {
            let list = allowed.join(", ");
            return Err(PolicyRefusal {
                fields: vec!["model"],
                detail: match model {
                    Some(_) => format!(
                        "`model` is `{asked}`, which this workspace may not use; its allowed models are: {list}"
                    ),
                    None => format!(
                        "`model` is absent and the default model `{asked}` is not one this workspace may use; name one of its allowed models: {list}"
                    ),
                },
            });
        }
    }
    if let (Some(asked), Some(cap)) = (max_output_tokens, policy.max_output_tokens)
        && asked > cap
    {
        return Err(PolicyRefusal {
            fields: vec!["max_output_tokens"],
            detail: format!(
                "`max_output_tokens` is {asked}, over this workspace's cap of {cap} (its max_output_tokens)"
            ),
        });
    }
    let bound = max_output_tokens.or(policy.max_output_tokens);
    let ceiling = token_ceiling(prompt_parts, bound);
    if let Some(limit) = policy.token_limit
        && ceiling > limit
    {
        return Err(PolicyRefusal {
            fields: vec!["max_output_tokens", "message", "context"],
            detail: format!(
                "the request may cost up to {ceiling} tokens (its prompt's bytes, {} per message, and {} output tokens), over this workspace's whole token quota of {limit}: no window could admit it; ask for fewer output tokens or send a shorter prompt",
                FRAMING_TOKENS_PER_MESSAGE,
                bound.map_or(DEFAULT_OUTPUT_CEILING, i64::from)
            ),
        });
    }
    Ok(Admitted {
        max_output_tokens: bound,
        token_ceiling: ceiling,
    })
}

/// Parses an operator's model list: names separated by commas, `any` for no list.
pub fn parse_models(text: &str) -> Result<Option<Vec<String>>, String> {
    if text.trim() == "any" {
        return Ok(None);
    }
    let models: Vec<String> = text
        .split(',')
        .map(|m| m.trim().to_owned())
        .filter(|m| !m.is_empty())
        .collect();
    if models.is_empty() {
        return Err(format!(
            "`{text}` names no model: give names separated by commas, or `any`"
        ));
    }
    if let Some(long) = models
        .iter()
        .find(|m| m.len() > crate::domain::limits::MAX_MODEL_BYTES)
    {
        return Err(format!(
            "model `{long}` is over {} bytes, longer than any request may name",
            crate::domain::limits::MAX_MODEL_BYTES
        ));
    }
    Ok(Some(models))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(models: Option<&[&str]>, cap: Option<u32>, tokens: Option<i64>) -> WorkspacePolicy {
        WorkspacePolicy {
            allowed_models: models.map(|m| m.iter().map(|s| s.to_string()).collect()),
            max_output_tokens: cap,
            token_limit: tokens,
            ..WorkspacePolicy::default()
        }
    }

    #[test]
    fn no_policy_admits_anything_and_reserves_the_default_output_ceiling() {
        let admitted = judge(&policy(None, None, None), Some("x"), "d", None, &[10]).unwrap();
        assert_eq!(admitted.max_output_tokens, None);
        assert_eq!(admitted.token_ceiling, 10 + 8 + DEFAULT_OUTPUT_CEILING);
    }

    #[test]
    fn a_model_outside_the_list_is_refused_naming_the_list() {
        let p = policy(Some(&["a", "b"]), None, None);
        let refusal = judge(&p, Some("c"), "a", None, &[1]).unwrap_err();
        assert_eq!(refusal.fields, vec!["model"]);
        assert!(refusal.detail.contains("`c`") && refusal.detail.contains("a, b"));
        assert!(judge(&p, Some("b"), "a", None, &[1]).is_ok());
    }

    #[test]
    fn an_absent_model_is_judged_as_the_default() {
        let p = policy(Some(&["a"]), None, None);
        assert!(judge(&p, None, "a", None, &[1]).is_ok());
        let refusal = judge(&p, None, "d", None, &[1]).unwrap_err();
        assert!(refusal.detail.contains("default model `d`"), "{refusal:?}");
    }

    #[test]
    fn the_cap_refuses_more_and_stands_in_for_an_absent_bound() {
        let p = policy(None, Some(500), None);
        let refusal = judge(&p, None, "d", Some(501), &[1]).unwrap_err();
        assert_eq!(refusal.fields, vec!["max_output_tokens"]);
        assert!(refusal.detail.contains("501") && refusal.detail.contains("500"));
        let at_cap = judge(&p, None, "d", Some(500), &[1]).unwrap();
        assert_eq!(at_cap.max_output_tokens, Some(500));
        let absent = judge(&p, None, "d", None, &[4, 6]).unwrap();
        assert_eq!(absent.max_output_tokens, Some(500));
        assert_eq!(absent.token_ceiling, 4 + 6 + 2 * 8 + 500);
    }

    #[test]
    fn a_ceiling_over_the_whole_token_quota_is_refused_as_never_admissible() {
        let p = policy(None, None, Some(1_000));
        let refusal = judge(&p, None, "d", Some(1_000), &[1]).unwrap_err();
        assert!(refusal.detail.contains("1009"), "{refusal:?}");
        assert!(judge(&p, None, "d", Some(991), &[1]).is_ok());
    }

    #[test]
    fn models_parse_from_a_list_or_any() {
        assert_eq!(parse_models("any").unwrap(), None);
        assert_eq!(
            parse_models(" a, b ,").unwrap(),
            Some(vec!["a".to_string(), "b".to_string()])
        );
        assert!(parse_models(" , ").is_err());
        assert!(parse_models(&"m".repeat(300)).is_err());
    }
}
