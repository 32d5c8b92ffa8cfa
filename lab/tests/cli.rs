//! The tools' binary offers the mock provider, the simulated browsers and the producer. (The
//! service's tests run it too: a test of this package is what makes `cargo test --workspace`
//! build it.)

use std::process::Command;

#[test]
fn the_tools_binary_offers_the_mock_the_browsers_and_the_producer() {
    let out = Command::new(env!("CARGO_BIN_EXE_replyd-lab"))
        .arg("--help")
        .output()
        .expect("replyd-lab runs");
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8(out.stdout).expect("the help is text");
    for command in ["mock-provider", "produce", "browsers"] {
        assert!(
            help.lines()
                .any(|line| line.trim_start().starts_with(command)),
            "`{command}` is not in replyd-lab's commands:\n{help}"
        );
    }
}
