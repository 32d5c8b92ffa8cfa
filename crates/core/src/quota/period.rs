//! The period an operator writes (`1d`, `12h`, `30m`, `90s`): parsed, bounded and printed.
//! A format of the command line and the settings, apart from the rules that use the period.

/// The longest period an operator may set: 3650 days. PostgreSQL does the window arithmetic
/// (a window's end is its start plus the period) and its timestamps end in 294276 AD, so a
/// period near `i64::MAX` seconds made every admission and read of the workspace fail with
/// "timestamp out of range". Ten years keeps every window's end far inside that range and
/// far beyond any billing period (a year is the longest in use); a workspace that should not
/// be limited takes `--limit none`. `migrations/V14__quota_period_bound.sql` holds the
/// database to the same bound.
pub const MAX_PERIOD_SECONDS: u64 = 3_650 * 86_400;

/// Parses an operator's period: a positive number of `d`, `h`, `m` or `s`, at most
/// [`MAX_PERIOD_SECONDS`].
pub fn parse_period(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} has no unit: write e.g. 1d, 12h, 30m or 90s"))?;
    let (number, unit) = text.split_at(split);
    let too_long = || {
        format!(
            "{text:?} is longer than the longest period, {} (for no limit, use --limit none)",
            format_period(MAX_PERIOD_SECONDS)
        )
    };
    let n: u64 = number.parse().map_err(|e: std::num::ParseIntError| {
        if *e.kind() == std::num::IntErrorKind::PosOverflow {
            too_long()
        } else {
            format!("{text:?} does not start with a number")
        }
    })?;
    let seconds = match unit {
        "d" => 86_400,
        "h" => 3_600,
        "m" => 60,
        "s" => 1,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?}: use d, h, m or s"
            ));
        }
    };
    match n.checked_mul(seconds) {
        Some(0) => Err(format!("{text:?} is not a positive period")),
        Some(total) if total <= MAX_PERIOD_SECONDS => Ok(total),
        _ => Err(too_long()),
    }
}

/// A period in seconds as the shortest exact form (`86400` → `1d`).
pub fn format_period(seconds: u64) -> String {
    for (unit, size) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
        if seconds.is_multiple_of(size) {
            return format!("{}{unit}", seconds / size);
        }
    }
    format!("{seconds}s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_parse_and_print() {
        assert_eq!(parse_period("1d"), Ok(86_400));
        assert_eq!(parse_period("12h"), Ok(43_200));
        assert_eq!(parse_period("30m"), Ok(1_800));
        assert_eq!(parse_period("90s"), Ok(90));
        for bad in ["", "d", "1", "0d", "1w", "-1d", "1.5h"] {
            assert!(parse_period(bad).is_err(), "{bad:?}");
        }
        // The longest period is accepted, anything longer refused with the bound named.
        assert_eq!(parse_period("3650d"), Ok(MAX_PERIOD_SECONDS));
        for too_long in ["3651d", "1000000000d", "87601h", "99999999999999999999s"] {
            let refused = parse_period(too_long).unwrap_err();
            assert!(refused.contains("3650d"), "{too_long}: {refused}");
        }
        assert_eq!(format_period(86_400), "1d");
        assert_eq!(format_period(5_400), "90m");
        assert_eq!(format_period(90), "90s");
    }
}
