//! The Grafana dashboard's panels (deploy/prometheus/grafana-dashboard.json) run against
//! a real Prometheus: every query of every panel evaluated through the HTTP API, and the
//! range results drawn as an SVG image of the dashboard (docs/dashboard.svg).

use std::fmt::Write as _;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::ops::http_get;

/// One panel: its title and, per query, its series (legend, points as (unix s, value)).
pub struct Panel {
    /// The panel's title.
    pub title: String,
    /// Every series of every query of the panel.
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

/// A panel's queries: `(expr, legendFormat)` of each.
pub type Queries = Vec<(String, String)>;

/// The dashboard's panels: title and queries.
pub fn panels() -> Result<Vec<(String, Queries)>> {
    let dashboard = crate::read_repo_json("deploy/prometheus/grafana-dashboard.json")?;
    let panels = dashboard["panels"].as_array().context("no panels")?;
    Ok(panels
        .iter()
        .map(|p| {
            let targets = p["targets"].as_array().cloned().unwrap_or_default();
            let queries = targets
                .iter()
                .map(|t| {
                    let expr = t["expr"].as_str().unwrap_or_default().to_string();
                    (
                        expr,
                        t["legendFormat"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect();
            (p["title"].as_str().unwrap_or_default().to_string(), queries)
        })
        .collect())
}

/// Percent-encodes `s` for a query string.
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Runs `path` on the Prometheus at `port`; its `data`, or an error with its complaint.
pub async fn api(port: u16, path: &str) -> Result<Value> {
    let (status, body) = http_get(port, path).await?;
    let body: Value = serde_json::from_str(&body).with_context(|| body.clone())?;
    if status != 200 || body["status"] != "success" {
        bail!("{path}: {status} {body}");
    }
    Ok(body["data"].clone())
}

/// Every panel's queries over `[start, end]` (unix seconds) at `step` seconds.
pub async fn query_range(port: u16, start: f64, end: f64, step: f64) -> Result<Vec<Panel>> {
    let mut out = Vec::new();
    for (title, queries) in panels()? {
        let mut series = Vec::new();
        for (expr, legend) in queries {
            let path = format!(
                "/api/v1/query_range?query={}&start={start}&end={end}&step={step}",
                encode(&expr)
            );
            let data = api(port, &path).await?;
            for result in data["result"].as_array().cloned().unwrap_or_default() {
                let name = legend_of(&legend, &result["metric"]);
                let points = result["values"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| {
                        let t = v[0].as_f64()?;
                        let y: f64 = v[1].as_str()?.parse().ok()?;
                        y.is_finite().then_some((t, y))
                    })
                    .collect();
                series.push((name, points));
            }
        }
        out.push(Panel { title, series });
    }
    Ok(out)
}

/// `legend` with every `{{label}}` replaced by the series' label value.
fn legend_of(legend: &str, metric: &Value) -> String {
    let mut text = legend.to_string();
    if let Some(labels) = metric.as_object() {
        for (k, v) in labels {
            text = text.replace(&format!("{{{{{k}}}}}"), v.as_str().unwrap_or_default());
        }
    }
    text
}

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// The panels drawn two per row as line charts, in SVG.
pub fn svg(panels: &[Panel]) -> String {
    let (w, h) = (560.0, 260.0);
    let rows = panels.len().div_ceil(2);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"#111217\"/>\n",
        2.0 * w + 30.0,
        rows as f64 * (h + 10.0) + 10.0
    );
    for (i, panel) in panels.iter().enumerate() {
        let x0 = 10.0 + (i % 2) as f64 * (w + 10.0);
        let y0 = 10.0 + (i / 2) as f64 * (h + 10.0);
        draw_panel(&mut out, panel, x0, y0, w, h);
    }
    out.push_str("</svg>\n");
    out
}

fn draw_panel(out: &mut String, panel: &Panel, x0: f64, y0: f64, w: f64, h: f64) {
    let _ = writeln!(
        out,
        "<rect x=\"{x0}\" y=\"{y0}\" width=\"{w}\" height=\"{h}\" fill=\"#181b1f\" stroke=\"#2c3235\"/>\
         <text x=\"{}\" y=\"{}\" fill=\"#ccccdc\" font-size=\"13\">{}</text>",
        x0 + 8.0,
        y0 + 18.0,
        escape(&panel.title)
    );
    let points = panel.series.iter().flat_map(|(_, p)| p.iter());
    let (mut tmin, mut tmax, mut ymax) = (f64::MAX, f64::MIN, 0.0f64);
    for &(t, y) in points {
        (tmin, tmax, ymax) = (tmin.min(t), tmax.max(t), ymax.max(y));
    }
    let (px, py, pw, ph) = (x0 + 50.0, y0 + 30.0, w - 60.0, h - 100.0);
    if panel.series.is_empty() || tmax <= tmin {
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" fill=\"#8e8e8e\">no data</text>",
            px + pw / 2.0 - 20.0,
            py + ph / 2.0
        );
        return;
    }
    let ymax = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
    let _ = writeln!(
        out,
        "<line x1=\"{px}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#464c54\"/>\
         <text x=\"{}\" y=\"{}\" fill=\"#8e8e8e\" text-anchor=\"end\">{}</text>\
         <text x=\"{}\" y=\"{}\" fill=\"#8e8e8e\" text-anchor=\"end\">0</text>",
        py + ph,
        px + pw,
        py + ph,
        px - 4.0,
        py + 8.0,
        short(ymax),
        px - 4.0,
        py + ph
    );
    // A crowded panel shows only its series that are ever above zero.
    let crowded = panel.series.len() > 4;
    let shown = panel
        .series
        .iter()
        .filter(|(_, pts)| !crowded || pts.iter().any(|&(_, y)| y > 0.0));
    for (n, (name, pts)) in shown.take(COLORS.len()).enumerate() {
        let color = COLORS[n % COLORS.len()];
        let path: Vec<String> = pts
            .iter()
            .map(|(t, y)| {
                let x = px + (t - tmin) / (tmax - tmin) * pw;
                format!("{x:.1},{:.1}", py + ph - y / ymax * ph)
            })
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>",
            path.join(" ")
        );
        {
            let lx = x0 + 10.0 + (n % 2) as f64 * (w / 2.0);
            let ly = y0 + h - 56.0 + (n / 2) as f64 * 13.0;
            let _ = writeln!(
                out,
                "<rect x=\"{lx}\" y=\"{}\" width=\"10\" height=\"3\" fill=\"{color}\"/>\
                 <text x=\"{}\" y=\"{ly}\" fill=\"#ccccdc\">{}</text>",
                ly - 4.0,
                lx + 14.0,
                escape(name)
            );
        }
    }
}

fn short(v: f64) -> String {
    match v {
        v if v >= 1e9 => format!("{:.1}G", v / 1e9),
        v if v >= 1e6 => format!("{:.1}M", v / 1e6),
        v if v >= 1e3 => format!("{:.1}k", v / 1e3),
        v if v >= 1.0 => format!("{v:.1}"),
        v => format!("{v:.3}"),
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
