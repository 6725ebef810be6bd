//! Minimal SVG line charts for the HTML report (no plotting dependency): linear axes with ticks, one polyline per
//! series, a legend.

/// Series colours (colour-blind friendly).
const COLORS: [&str; 8] =
    ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000"];

/// One named line.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A "nice" tick step for a range.
fn tick_step(range: f64) -> f64 {
    if range <= 0.0 || !range.is_finite() {
        return 1.0;
    }
    let raw = range / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    mag * if f < 1.5 {
        1.0
    } else if f < 3.5 {
        2.0
    } else if f < 7.5 {
        5.0
    } else {
        10.0
    }
}

fn fmt_tick(v: f64) -> String {
    if v.abs() >= 1000.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The widest an 11-pixel sans-serif character is taken to be, in pixels (a generous average: `m` and `w` are
/// wider, `i` and `l` narrower; labels are mostly lower case and `_`).
const CHAR_PX: f64 = 6.6;
/// The plot area's width, in pixels; the legend's column widens the chart as its longest name needs.
const PLOT_W: f64 = 426.0;

/// A line chart: a plot area of [`PLOT_W`] x 246 pixels, the legend to its right as wide as its longest name.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let longest = series.iter().map(|s| s.name.chars().count()).max().unwrap_or(0) as f64;
    let (left, top, bottom) = (64.0, 30.0, 44.0);
    let right = (32.0 + longest * CHAR_PX + 8.0).max(150.0);
    let (w, h) = ((left + PLOT_W + right).ceil(), 320.0);
    let pts = series.iter().flat_map(|s| s.points.iter()).filter(|p| p.0.is_finite() && p.1.is_finite());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::NEG_INFINITY);
    for p in pts {
        x0 = x0.min(p.0);
        x1 = x1.max(p.0);
        y1 = y1.max(p.1);
    }
    if !x0.is_finite() {
        (x0, x1, y1) = (0.0, 1.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let y0 = 0.0;
    if y1 <= y0 {
        y1 = 1.0;
    }
    let (pw, ph) = (w - left - right, h - top - bottom);
    let sx = |x: f64| left + (x - x0) / (x1 - x0) * pw;
    let sy = |y: f64| top + ph - (y - y0) / (y1 - y0) * ph;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
         font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"18\" font-size=\"13\" font-weight=\"bold\">{}</text>\n",
        left,
        esc(title)
    );
    let xs = tick_step(x1 - x0);
    let mut t = (x0 / xs).ceil() * xs;
    while t <= x1 + xs * 1e-9 {
        let x = sx(t);
        svg += &format!(
            "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/><text x=\"{x:.1}\" y=\"{:.1}\" \
             text-anchor=\"middle\">{}</text>\n",
            top,
            top + ph,
            top + ph + 14.0,
            fmt_tick(t)
        );
        t += xs;
    }
    let ys = tick_step(y1 - y0);
    let mut t = y0;
    while t <= y1 + ys * 1e-9 {
        let y = sy(t);
        svg += &format!(
            "<line x1=\"{left}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{:.1}\" y=\"{:.1}\" \
             text-anchor=\"end\">{}</text>\n",
            left + pw,
            left - 4.0,
            y + 4.0,
            fmt_tick(t)
        );
        t += ys;
    }
    svg += &format!(
        "<rect x=\"{left}\" y=\"{top}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#888\"/>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n\
         <text transform=\"translate(14 {:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
        left + pw / 2.0,
        h - 8.0,
        esc(x_label),
        top + ph / 2.0,
        esc(y_label)
    );
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = s
            .points
            .iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .map(|p| format!("{:.1},{:.1}", sx(p.0), sy(p.1)))
            .collect();
        if !path.is_empty() {
            svg += &format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n",
                path.join(" ")
            );
        }
        let ly = top + 10.0 + 16.0 * i as f64;
        svg += &format!(
            "<line x1=\"{:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{color}\" stroke-width=\"3\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>\n",
            left + pw + 10.0,
            left + pw + 28.0,
            left + pw + 32.0,
            ly + 4.0,
            esc(&s.name)
        );
    }
    svg + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_well_formed_and_escaped() {
        let s = Series { name: "a<b".into(), points: vec![(0.0, 0.0), (1.0, 2.0), (f64::NAN, 1.0)] };
        let svg = line_chart("T & T", "x", "y", &[s]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a&lt;b") && svg.contains("T &amp; T") && svg.contains("<polyline"));
        assert!(!svg.contains("NaN"));
        assert!(line_chart("empty", "x", "y", &[]).contains("</svg>"));
        // The legend's column holds its longest name: the default policy's, which the fixed width cut.
        let long = Series { name: "cache_aware_measured".into(), points: vec![(0.0, 1.0)] };
        let svg = line_chart("t", "x", "y", &[long]);
        let width: f64 = svg
            .split("width=\"")
            .nth(1)
            .and_then(|v| v.split('"').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        let text_x: f64 = svg
            .split("<text x=\"")
            .last()
            .and_then(|v| v.split('"').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::MAX);
        assert!(text_x + 20.0 * CHAR_PX <= width, "legend at {text_x}, chart {width} wide");
        assert!(
            line_chart("t", "x", "y", &[])
                .starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"640\""),
            "short names keep 640"
        );
        assert_eq!(tick_step(10.0), 2.0);
        assert_eq!(tick_step(0.9), 0.2);
    }
}
