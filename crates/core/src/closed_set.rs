//! Closed sets: enums whose values are kept as text in a column with a `CHECK` list. Each
//! derives its texts, its list of values and its reading from its variants (strum's
//! `IntoStaticStr`, `VariantArray` and `EnumString`), so a new value cannot be left out of any
//! of them; [`ClosedSet`] gives the three one name for every set.

use std::str::FromStr;

use strum::VariantArray;

/// A closed set's values and their texts.
pub trait ClosedSet: Copy + VariantArray + FromStr + Into<&'static str> {
    /// Every value, in the order declared, as its column's `CHECK` list holds them (a test
    /// holds the two together).
    fn all() -> &'static [Self] {
        Self::VARIANTS
    }

    /// The value's text, as stored.
    fn as_str(self) -> &'static str {
        self.into()
    }

    /// The value a stored text names; None for any other text.
    fn parse(text: &str) -> Option<Self> {
        text.parse().ok()
    }
}

impl<T: Copy + VariantArray + FromStr + Into<&'static str>> ClosedSet for T {}
