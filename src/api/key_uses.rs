//! When an API process last wrote each key's use (`api_keys.last_used_at`, `replyd api-key
//! list`): at most once a minute per key, so a request costs no statement for it.

/// How often one process writes a key's last use.
pub const INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// When this process last wrote each key's use. Only keys that authenticated get an entry,
/// so it holds the workspace's keys, not what callers send.
#[derive(Debug, Default)]
pub struct KeyUses(std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>);

impl KeyUses {
    /// Whether `key_id`'s use is due to be written at `now` (and, if so, that it is).
    pub fn due(&self, key_id: &str, now: std::time::Instant) -> bool {
        let mut last = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match last.get(key_id) {
            Some(at) if now.duration_since(*at) < INTERVAL => false,
            _ => {
                last.insert(key_id.to_owned(), now);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_s_use_is_written_at_most_once_a_minute_per_process() {
        let uses = KeyUses::default();
        let start = std::time::Instant::now();
        assert!(uses.due("a", start));
        assert!(!uses.due("a", start + std::time::Duration::from_secs(59)));
        assert!(uses.due("b", start), "each key on its own");
        assert!(uses.due("a", start + INTERVAL));
    }
}
