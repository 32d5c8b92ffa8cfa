//! The image: hadolint passes the Dockerfile, its dependencies build in a layer before any
//! source, every file it copies is in the build context, the chart, the image and the binary
//! name the crate's version, and a port changed in the values reaches the process the probes
//! ask.

use super::render::{chart, config_of, render, root, run, scratch, text};
use crate::helpers::{free_port, infra, unique};

#[test]
fn hadolint_passes_the_dockerfile() {
    let out = run(
        &infra("HADOLINT"),
        &["--config", ".hadolint.yaml", "deploy/Dockerfile"],
    );
    assert!(out.status.success(), "hadolint: {}", text(&out));
    // The image runs as a non-root user, with replyd as its entrypoint and its own health check;
    // its build has the files `src/api/demo.rs` embeds.
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    for line in [
        "USER 10001:10001",
        "ENTRYPOINT [\"/usr/local/bin/replyd\"]",
        "CMD [\"/usr/local/bin/replyd\", \"healthz\"]",
        "COPY clients/typescript/demo clients/typescript/demo",
        "COPY clients/typescript/dist clients/typescript/dist",
    ] {
        assert!(dockerfile.contains(line), "the Dockerfile has {line}");
    }
}

#[test]
fn the_image_builds_its_dependencies_in_a_layer_before_any_source() {
    // In the stage that builds the binary, the dependencies are built (from cargo-chef's
    // recipe) before any source directory is copied: a change to the sources alone reuses the
    // dependency layer. The Dockerfile as it was copied src before its only build.
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    let stage: Vec<&str> = dockerfile
        .lines()
        .skip_while(|l| !(l.starts_with("FROM ") && l.ends_with(" AS build")))
        .skip(1)
        .take_while(|l| !l.starts_with("FROM "))
        .collect();
    assert!(!stage.is_empty(), "a stage named build");
    let position = |what: &dyn Fn(&str) -> bool| stage.iter().position(|l| what(l));
    let cook = position(&|l: &str| l.starts_with("RUN cargo chef cook --release --locked"))
        .expect("the dependencies are cooked in the build stage");
    let first_source = position(&|l: &str| {
        l.starts_with("COPY ") && !l.starts_with("COPY --from=planner") && !l.contains("Cargo.")
    })
    .expect("the sources are copied");
    let build = position(&|l: &str| l.starts_with("RUN cargo build --release --locked"))
        .expect("the binary is built");
    assert!(cook < first_source && first_source < build, "{stage:#?}");
    // The recipe the cook reads comes from a stage of its own, not from the sources here.
    assert!(
        stage[..cook]
            .iter()
            .any(|l| l.starts_with("COPY --from=planner")),
        "{stage:#?}"
    );
}

/// The `ENV` instructions of the Dockerfile's last stage (the image that runs), as name and
/// value, continuation lines joined.
fn image_env() -> Vec<(String, String)> {
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    let last_stage = dockerfile.rsplit("\nFROM ").next().unwrap();
    let joined = last_stage.replace("\\\n", " ");
    joined
        .lines()
        .filter_map(|line| line.trim().strip_prefix("ENV "))
        .flat_map(|pairs| pairs.split_whitespace())
        .map(|pair| {
            let (name, value) = pair.split_once('=').expect("ENV name=value");
            (name.to_owned(), value.trim_matches('"').to_owned())
        })
        .collect()
}

/// The port of every `containerPort` named `name` in the manifests.
fn container_ports(manifests: &str, name: &str) -> Vec<u16> {
    let needle = format!("- name: {name}\n");
    manifests
        .match_indices(&needle)
        .filter_map(|(at, _)| {
            manifests[at + needle.len()..]
                .lines()
                .next()?
                .trim()
                .strip_prefix("containerPort: ")?
                .parse()
                .ok()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_changed_in_the_values_reaches_the_process_the_probes_ask() {
    // What the kubelet does: the chart's values give the container's ports, and the probes ask
    // them. The process must listen where they ask, whatever the image sets.
    let (metrics, api) = (free_port(), free_port());
    let out = render(
        &[],
        &[
            "mode=serve",
            &format!("settings.observability.listen=127.0.0.1:{metrics}"),
            &format!("settings.api.listen=127.0.0.1:{api}"),
        ],
    );
    assert!(out.status.success(), "helm template: {}", text(&out));
    let manifests = String::from_utf8(out.stdout).unwrap();
    assert_eq!(container_ports(&manifests, "metrics"), vec![metrics]);
    assert_eq!(container_ports(&manifests, "http"), vec![api]);
    let file = scratch().join("replyd.toml");
    std::fs::write(&file, config_of(&manifests)).unwrap();

    // The process as the pod starts it: the image's environment, then the container's, where
    // REPLYD_CONFIG names the mounted ConfigMap (here, the file it renders) and the secrets
    // and this machine's broker come as variables.
    let db = crate::helpers::TestDb::new().await;
    let mut serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_replyd"));
    serve
        .arg("serve")
        .envs(image_env())
        .env("REPLYD_CONFIG", &file)
        .env("REPLYD_DATABASE__URL", db.settings.url.expose())
        .env("REPLYD_KAFKA__BOOTSTRAP_SERVERS", infra("KAFKA_BOOTSTRAP"))
        .env("REPLYD_KAFKA__TOPIC", unique("tasks"))
        .env("REPLYD_KAFKA__GROUP_ID", unique("group"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = serve.spawn().unwrap();
    let client = reqwest::Client::new();
    let answered = |port: u16, path: &'static str| {
        let client = client.clone();
        async move {
            client
                .get(format!("http://127.0.0.1:{port}{path}"))
                .timeout(std::time::Duration::from_secs(2))
                .send()
                .await
                .is_ok()
        }
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !(answered(metrics, "/healthz").await && answered(api, "/v1/quota").await) {
        if let Some(status) = child.try_wait().unwrap() {
            let mut said = String::new();
            use tokio::io::AsyncReadExt as _;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut said)
                .await
                .unwrap();
            panic!("replyd serve exited ({status}) before answering on its ports: {said}");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing answered on the ports the values gave ({metrics}, {api})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    child.kill().await.unwrap();
}

#[test]
fn every_file_the_image_copies_from_the_build_context_is_in_it() {
    // .dockerignore keeps deploy/ (and more) out of the build context; a COPY of a file under
    // it fails the build, which no engine here would show.
    let ignored: Vec<String> = std::fs::read_to_string(root().join(".dockerignore"))
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    let sources: Vec<&str> = dockerfile
        .lines()
        .filter_map(|l| l.trim().strip_prefix("COPY "))
        .filter(|args| !args.starts_with("--from"))
        .flat_map(|args| {
            let words: Vec<&str> = args.split_whitespace().collect();
            words[..words.len() - 1].to_vec()
        })
        .collect();
    assert!(
        sources.contains(&"deploy/image-defaults.toml"),
        "{sources:?}"
    );
    for source in sources {
        let excluded = ignored.iter().any(|rule| {
            !rule.starts_with('!') && (source == rule || source.starts_with(&format!("{rule}/")))
        });
        let excepted = ignored
            .iter()
            .any(|rule| rule.strip_prefix('!') == Some(source));
        assert!(
            !excluded || excepted,
            "the Dockerfile copies {source}, which .dockerignore keeps out of the context"
        );
        assert!(root().join(source).exists(), "{source} does not exist");
    }
}

#[test]
fn the_chart_the_image_and_the_binary_name_the_crate_s_version() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("the crate's version");
    let chart = std::fs::read_to_string(chart().join("Chart.yaml")).unwrap();
    assert!(
        chart.contains(&format!("appVersion: \"{version}\"")),
        "Chart.yaml's appVersion is the crate's {version}:\n{chart}"
    );
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    assert!(
        dockerfile.contains(&format!("ARG VERSION={version}\n")),
        "the Dockerfile's default VERSION is the crate's {version}"
    );
    let out = run(env!("CARGO_BIN_EXE_replyd"), &["--version"]);
    assert!(out.status.success(), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.starts_with(&format!("replyd {version} (commit ")),
        "{said}"
    );
}
