//! The demo chat page (`api.demo_page`): `/demo` and its scripts, built from
//! `clients/typescript` (the page, the client package and its one dependency) and embedded in
//! the binary, so the page needs nothing at run time but this server. It is on the API's
//! origin, so it calls the API without CORS.
//!
//! Every answer carries a Content-Security-Policy that allows only this origin's scripts,
//! styles and connections, and the page's one inline script (its import map) by its hash.

use std::sync::LazyLock;

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine as _;
use sha2::{Digest, Sha256};

/// One embedded file: where it is served, its type, its text.
struct Asset {
    path: &'static str,
    content_type: &'static str,
    text: &'static str,
}

macro_rules! asset {
    ($path:literal, $type:expr, $file:literal) => {
        Asset {
            path: $path,
            content_type: $type,
            text: include_str!(concat!("../../clients/typescript/", $file)),
        }
    };
}

const JS: &str = "text/javascript; charset=utf-8";

/// Every file of the page. `tests` below holds this list to the build's output, so a module
/// added to the client cannot be left out.
const ASSETS: [Asset; 11] = [
    asset!("/demo", "text/html; charset=utf-8", "demo/index.html"),
    asset!(
        "/demo/style.css",
        "text/css; charset=utf-8",
        "demo/style.css"
    ),
    asset!("/demo/app.js", JS, "demo/dist/app.js"),
    asset!(
        "/demo/vendor/eventsource-parser/index.js",
        JS,
        "demo/dist/vendor/eventsource-parser/index.js"
    ),
    asset!("/demo/client/index.js", JS, "dist/index.js"),
    asset!("/demo/client/client.js", JS, "dist/client.js"),
    asset!("/demo/client/errors.js", JS, "dist/errors.js"),
    asset!("/demo/client/openapi.js", JS, "dist/openapi.js"),
    asset!("/demo/client/presses.js", JS, "dist/presses.js"),
    asset!("/demo/client/retry.js", JS, "dist/retry.js"),
    asset!("/demo/client/types.js", JS, "dist/types.js"),
];

/// The page's one inline script (its import map), allowed by its hash.
static IMPORT_MAP_HASH: LazyLock<String> = LazyLock::new(|| {
    let page = ASSETS[0].text;
    let open = r#"<script type="importmap">"#;
    let start = page.find(open).expect("the page has an import map") + open.len();
    let end = start
        + page[start..]
            .find("</script>")
            .expect("the import map ends");
    base64::engine::general_purpose::STANDARD.encode(Sha256::digest(&page[start..end]))
});

/// The policy of every demo answer: this origin's scripts and styles, and connections to this
/// origin and, when the page calls an API on another (`api`), to that one.
fn content_security_policy(api: Option<&str>) -> HeaderValue {
    let connect = match api {
        Some(api) => format!("'self' {api}"),
        None => "'self'".to_owned(),
    };
    let policy = format!(
        "default-src 'none'; script-src 'self' 'sha256-{}'; style-src 'self'; connect-src {connect}; \
         base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        *IMPORT_MAP_HASH
    );
    HeaderValue::from_str(&policy).expect("a policy of ASCII")
}

fn serve(asset: &'static Asset, policy: HeaderValue) -> Response {
    let mut response = asset.text.into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(asset.content_type),
    );
    headers.insert(header::CONTENT_SECURITY_POLICY, policy);
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // The files change only with the binary; revalidating costs little on a demo.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// The page's routes (`/demo` and `/demo/` both give the page), on the API's own origin.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    pages(None)
}

/// The page's routes as a product's own server serves them, on another origin than the API at
/// `api` (an origin such as `http://127.0.0.1:8080`), which the page may then call.
pub fn pages<S: Clone + Send + Sync + 'static>(api: Option<&str>) -> Router<S> {
    let policy = content_security_policy(api);
    let page = policy.clone();
    let mut router = Router::new().route(
        "/demo/",
        get(move || async move { serve(&ASSETS[0], page) }),
    );
    for asset in &ASSETS {
        let policy = policy.clone();
        router = router.route(asset.path, get(move || async move { serve(asset, policy) }));
    }
    router
}

#[cfg(test)]
mod tests {
    use super::*;

    fn built(dir: &str) -> Vec<String> {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/typescript/");
        let mut found = Vec::new();
        let mut stack = vec![std::path::PathBuf::from(root).join(dir)];
        while let Some(at) = stack.pop() {
            for entry in std::fs::read_dir(&at).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "js") {
                    found.push(path.strip_prefix(root).unwrap().display().to_string());
                }
            }
        }
        found.sort();
        found
    }

    #[test]
    fn every_built_module_is_served() {
        let served: Vec<&str> = ASSETS.iter().map(|a| a.path).collect();
        for file in built("dist").into_iter().chain(built("demo/dist")) {
            let path = file
                .replace("demo/dist/", "/demo/")
                .replace("dist/", "/demo/client/");
            assert!(served.contains(&path.as_str()), "{file} is not served");
        }
    }

    #[test]
    fn the_policy_allows_the_import_map_by_its_hash_only() {
        let own = content_security_policy(None);
        let policy = own.to_str().unwrap();
        assert!(policy.contains("script-src 'self' 'sha256-"), "{policy}");
        assert!(!policy.contains("unsafe-inline"), "{policy}");
        assert!(policy.contains("connect-src 'self';"), "{policy}");
    }

    #[test]
    fn a_products_page_may_connect_to_its_api_and_nothing_else() {
        let other = content_security_policy(Some("http://127.0.0.1:8080"));
        let policy = other.to_str().unwrap();
        assert!(
            policy.contains("connect-src 'self' http://127.0.0.1:8080;"),
            "{policy}"
        );
    }
}
