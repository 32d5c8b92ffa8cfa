//! Which schema a binary can run against, so that a release can be rolled back by changing
//! its image and nothing else.
//!
//! Migrations expand the schema: the release before still works against it. A later release
//! contracts what no release it can be rolled back to uses, and raises the schema's floor
//! (`schema_compatibility`, V35): the newest migration a binary must know to work with what is
//! left, and the release that first shipped it. A binary that knows migrations up to the floor
//! runs against a schema that a later release migrated further, and leaves those migrations be;
//! one that does not refuses, naming the release it needs.

use std::fmt;

/// The schema's floor: a binary must know migration `version` (first shipped by `release`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Floor {
    pub version: i32,
    pub release: String,
}

/// How the schema stands to a binary that can run against it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fit {
    /// Every applied migration is one this binary knows (some of its own may be pending).
    Known,
    /// A later release applied these migrations, which this binary does not know; they only
    /// expand the schema, so it runs and applies none of them.
    Ahead { newer: Vec<i32> },
}

/// The schema was contracted past what this binary knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooNew {
    /// The newest migration this binary knows.
    pub known: i32,
    /// The newest migration applied.
    pub newest: i32,
    pub floor: Floor,
}

impl fmt::Display for TooNew {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the database schema (at V{}) was contracted by a later release and needs a binary \
             that knows migration V{} (replyd {} or later); this binary knows migrations up to \
             V{}: run replyd {} or later",
            self.newest, self.floor.version, self.floor.release, self.known, self.floor.release
        )
    }
}

impl std::error::Error for TooNew {}

/// Judges the schema (the `applied` migrations' versions and its floor, if it has one) for a
/// binary that knows the migrations `known`.
pub fn judge(known: &[i32], applied: &[i32], floor: Option<&Floor>) -> Result<Fit, TooNew> {
    let newest_known = known.iter().copied().max().unwrap_or(0);
    let mut newer: Vec<i32> = applied
        .iter()
        .copied()
        .filter(|v| *v > newest_known)
        .collect();
    if newer.is_empty() {
        return Ok(Fit::Known);
    }
    newer.sort_unstable();
    match floor {
        Some(floor) if floor.version > newest_known => Err(TooNew {
            known: newest_known,
            newest: *newer.last().expect("not empty"),
            floor: floor.clone(),
        }),
        // No floor: nothing was ever contracted (a schema from before the floor was kept).
        _ => Ok(Fit::Ahead { newer }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floor(version: i32) -> Floor {
        Floor {
            version,
            release: "9.1.0".into(),
        }
    }

    #[test]
    fn a_schema_this_binary_knows_fits_whether_or_not_it_is_behind() {
        assert_eq!(
            judge(&[1, 2, 3], &[1, 2, 3], Some(&floor(2))),
            Ok(Fit::Known)
        );
        assert_eq!(judge(&[1, 2, 3], &[1], Some(&floor(1))), Ok(Fit::Known));
        assert_eq!(judge(&[1, 2, 3], &[], None), Ok(Fit::Known));
    }

    #[test]
    fn a_schema_a_later_release_expanded_is_run_against_and_its_migrations_left_be() {
        assert_eq!(
            judge(&[1, 2, 3], &[1, 2, 3, 5, 4], Some(&floor(3))),
            Ok(Fit::Ahead { newer: vec![4, 5] })
        );
        assert_eq!(
            judge(&[1, 2, 3], &[1, 2, 3, 4], None),
            Ok(Fit::Ahead { newer: vec![4] })
        );
    }

    #[test]
    fn a_schema_contracted_past_this_binary_is_refused_naming_the_release_it_needs() {
        let refused = judge(&[1, 2, 3], &[1, 2, 3, 4, 5], Some(&floor(4))).unwrap_err();
        assert_eq!(
            refused,
            TooNew {
                known: 3,
                newest: 5,
                floor: floor(4)
            }
        );
        let said = refused.to_string();
        for part in ["V5", "V4", "replyd 9.1.0 or later", "up to V3"] {
            assert!(said.contains(part), "{part} not in: {said}");
        }
    }
}
