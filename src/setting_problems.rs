//! What a settings section finds wrong with itself, each problem naming its setting: every
//! section's `problems()` gathers its own, and the settings tree turns them all into its one
//! error. A leaf: it names no section.

/// The problems a section found, each with the setting it names.
#[derive(Debug, Default)]
pub struct SettingProblems(Vec<(&'static str, String)>);

impl SettingProblems {
    /// Refuses `setting`, saying why.
    pub fn refuse(&mut self, setting: &'static str, message: String) {
        self.0.push((setting, message));
    }
}

impl From<SettingProblems> for Vec<(&'static str, String)> {
    fn from(problems: SettingProblems) -> Self {
        problems.0
    }
}
