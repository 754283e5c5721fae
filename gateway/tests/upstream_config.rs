//! The model server's client as the gateway's configuration makes it: a URL that is not
//! `http(s)://` and a CA file that cannot be read are refused at start, and the API key
//! never shows in debug output.

use toolfleet_common::tls::TlsFiles;
use toolfleet_gateway::config::UpstreamConfig;
use toolfleet_gateway::openai::{Upstream, UpstreamError};

#[test]
fn the_model_servers_key_never_shows_in_debug_output() {
    let config = UpstreamConfig {
        api_key: Some("sk-very-secret".into()),
        ..UpstreamConfig::default()
    };
    assert!(!format!("{config:?}").contains("sk-very-secret"));
    let upstream = Upstream::new(&UpstreamConfig {
        base_url: Some("http://127.0.0.1:1/v1".into()),
        ..config.clone()
    })
    .expect("client")
    .expect("configured");
    assert!(!format!("{upstream:?}").contains("sk-very-secret"));
}

#[test]
fn an_upstream_url_that_is_not_http_is_refused_at_start() {
    for url in ["ftp://models.example/v1", "models.example/v1", "http://"] {
        let outcome = Upstream::new(&UpstreamConfig {
            base_url: Some(url.into()),
            ..UpstreamConfig::default()
        });
        assert!(
            matches!(outcome, Err(UpstreamError::Url { .. })),
            "{url}: {outcome:?}"
        );
    }
    let missing_ca = Upstream::new(&UpstreamConfig {
        base_url: Some("https://models.example/v1".into()),
        tls: TlsFiles::trusting("/nonexistent/ca.pem"),
        ..UpstreamConfig::default()
    });
    assert!(matches!(missing_ca, Err(UpstreamError::Tls(_))));
}
