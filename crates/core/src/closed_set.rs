//! Closed sets: enums whose values are kept as text in a column with a `CHECK` list, each value
//! declared with its text.

/// Declares an enum whose every value has a text, with `ALL` (every value, in the order
/// declared), `as_str` and `parse`, all made from the one table of values and texts, so that a
/// new value cannot be left out of any of them.
macro_rules! closed_set {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $(
                $(#[$variant_meta:meta])*
                $variant:ident => $text:literal
            ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        pub enum $name {
            $(
                $(#[$variant_meta])*
                $variant,
            )+
        }

        impl $name {
            /// Every value, in the order declared, as its column's `CHECK` list holds them (a
            /// test holds the two together).
            pub const ALL: [$name; [$($text),+].len()] = [$($name::$variant),+];

            /// The value's text, as stored.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }

            /// The value a stored text names; None for any other text.
            pub fn parse(text: &str) -> Option<Self> {
                match text {
                    $($text => Some($name::$variant),)+
                    _ => None,
                }
            }
        }
    };
}
