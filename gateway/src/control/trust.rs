//! Who may register a worker: the `advertise_url` of a report must name a host the operator allows, so that a
//! report (even one carrying the secret) cannot point the gateway, and with it clients' prompts, at an arbitrary
//! address.
//!
//! With no `--advertise-allow` entries the host must be the report's own source address, or a name that resolves
//! to it (a Kubernetes pod's DNS name, checked once and remembered for [`VERIFIED_TTL`]). With entries, the host must
//! match one: an IP, a CIDR, an exact host name, or a `*.suffix` pattern. Pure except [`AdvertiseCheck::check`]'s
//! name resolution, which runs on the report-ingest thread.

use std::collections::HashMap;
use std::net::{IpAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

/// How long a (host, source address) pair that resolved correctly is trusted without resolving it again.
pub const VERIFIED_TTL: Duration = Duration::from_secs(60);
/// Most remembered pairs (oldest dropped first).
pub const MAX_VERIFIED: usize = 8192;

/// One `--advertise-allow` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowEntry {
    Ip(IpAddr),
    Cidr(IpAddr, u8),
    Host(String),
    Suffix(String),
}

impl AllowEntry {
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Err("empty".into());
        }
        if let Some((ip, bits)) = s.split_once('/') {
            let ip: IpAddr = ip.parse().map_err(|_| format!("{ip:?} is not an IP address"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            let bits: u8 = bits.parse().map_err(|_| format!("{bits:?} is not a prefix length"))?;
            if bits > max {
                return Err(format!("prefix length {bits} is over {max}"));
            }
            return Ok(AllowEntry::Cidr(ip, bits));
        }
        if let Ok(ip) = s.trim_matches(['[', ']']).parse::<IpAddr>() {
            return Ok(AllowEntry::Ip(ip));
        }
        let valid = |h: &str| {
            !h.is_empty() && h.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
        };
        if let Some(suffix) = s.strip_prefix("*.") {
            if !valid(suffix) {
                return Err(format!("{s:?} is not a *.domain pattern"));
            }
            return Ok(AllowEntry::Suffix(format!(".{}", suffix.to_ascii_lowercase())));
        }
        if !valid(s) {
            return Err(format!("{s:?} is not an IP, CIDR, host name or *.domain pattern"));
        }
        Ok(AllowEntry::Host(s.to_ascii_lowercase()))
    }

    /// Whether `host` (an IP or a lower-cased name from a URL) matches.
    pub fn matches(&self, host: &str) -> bool {
        let ip = host.trim_matches(['[', ']']).parse::<IpAddr>().ok();
        match (self, ip) {
            (AllowEntry::Ip(a), Some(ip)) => *a == ip,
            (AllowEntry::Cidr(net, bits), Some(ip)) => in_cidr(ip, *net, *bits),
            (AllowEntry::Host(h), None) => host == h,
            (AllowEntry::Suffix(s), None) => host.ends_with(s.as_str()) && host.len() > s.len(),
            _ => false,
        }
    }
}

fn in_cidr(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = if bits == 0 { 0 } else { u32::MAX << (32 - u32::from(bits)) };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = if bits == 0 { 0 } else { u128::MAX << (128 - u32::from(bits)) };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// The host of an `http://host:port/...` URL, lower-cased (IPv6 without brackets); `None` if it has none.
pub fn url_host(url: &str) -> Option<String> {
    let uri: hyper::Uri = url.parse().ok()?;
    if uri.scheme_str() != Some("http") {
        return None;
    }
    let host = uri.host()?.trim_matches(['[', ']']).to_ascii_lowercase();
    (!host.is_empty()).then_some(host)
}

/// The advertise-URL check, with its memory of names that resolved to their reporter.
#[derive(Debug)]
pub struct AdvertiseCheck {
    allow: Vec<AllowEntry>,
    verified: HashMap<(String, IpAddr), Instant>,
}

impl AdvertiseCheck {
    /// Entries must have passed [`AllowEntry::parse`] (config validation); invalid ones are skipped.
    pub fn new(allow: &[String]) -> Self {
        Self {
            allow: allow.iter().filter_map(|a| AllowEntry::parse(a).ok()).collect(),
            verified: HashMap::new(),
        }
    }

    /// `Ok` if a worker reporting from `source` may be reached at `advertise_url`; else why not.
    pub fn check(&mut self, advertise_url: &str, source: IpAddr, now: Instant) -> Result<(), String> {
        let host = url_host(advertise_url)
            .ok_or_else(|| format!("advertise_url {advertise_url:?} is not an http://host:port URL"))?;
        if !self.allow.is_empty() {
            return if self.allow.iter().any(|a| a.matches(&host)) {
                Ok(())
            } else {
                Err(format!("advertise_url host {host:?} is not in --advertise-allow"))
            };
        }
        let source = canonical(source);
        if let Ok(ip) = host.parse::<IpAddr>() {
            return if canonical(ip) == source {
                Ok(())
            } else {
                Err(format!("advertise_url host {ip} is not the report's source address {source}"))
            };
        }
        let key = (host.clone(), source);
        if self.verified.get(&key).is_some_and(|t| now.duration_since(*t) < VERIFIED_TTL) {
            return Ok(());
        }
        let resolved: Vec<IpAddr> = (host.as_str(), 80)
            .to_socket_addrs()
            .map_err(|e| format!("advertise_url host {host:?} does not resolve: {e}"))?
            .map(|a| canonical(a.ip()))
            .collect();
        if !resolved.contains(&source) {
            return Err(format!(
                "advertise_url host {host:?} does not resolve to the report's source address {source}"
            ));
        }
        if self.verified.len() >= MAX_VERIFIED {
            self.verified.retain(|_, t| now.duration_since(*t) < VERIFIED_TTL);
            if self.verified.len() >= MAX_VERIFIED {
                self.verified.clear();
            }
        }
        self.verified.insert(key, now);
        Ok(())
    }
}

/// IPv4-mapped IPv6 addresses as IPv4, so a dual-stack listener compares like with like.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_and_match() {
        let cidr = AllowEntry::parse("10.1.0.0/16").expect("cidr");
        assert!(cidr.matches("10.1.200.3") && !cidr.matches("10.2.0.1") && !cidr.matches("example.com"));
        let v6 = AllowEntry::parse("fd00::/8").expect("v6 cidr");
        assert!(v6.matches("fd12::1") && !v6.matches("fe80::1"));
        let suffix = AllowEntry::parse("*.kvgate-worker.ns.svc.cluster.local").expect("suffix");
        assert!(suffix.matches("kvgate-worker-0.kvgate-worker.ns.svc.cluster.local"));
        assert!(!suffix.matches("kvgate-worker.ns.svc.cluster.local"));
        assert!(!suffix.matches("evil.kvgate-worker.ns.svc.cluster.local.attacker.io"));
        assert!(AllowEntry::parse("Worker-1.Local").expect("host").matches("worker-1.local"));
        assert!(AllowEntry::parse("[::1]").expect("ip").matches("::1"));
        for bad in ["", "10.0.0.0/33", "*.", "a b", "x/y", "http://x"] {
            assert!(AllowEntry::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn without_entries_the_host_must_be_the_source() {
        let mut c = AdvertiseCheck::new(&[]);
        let now = Instant::now();
        let local: IpAddr = "127.0.0.1".parse().expect("ip");
        assert!(c.check("http://127.0.0.1:8000", local, now).is_ok());
        assert!(c.check("http://10.9.9.9:8000", local, now).is_err(), "another address");
        assert!(c.check("http://localhost:8000", local, now).is_ok(), "a name that resolves to the source");
        assert!(c.check("http://127.0.0.1:8000", "::ffff:127.0.0.1".parse().expect("mapped"), now).is_ok());
        assert!(c.check("ftp://127.0.0.1", local, now).is_err());
        assert!(c.check("http://no-such-host.invalid:8000", local, now).is_err());
    }

    #[test]
    fn with_entries_only_they_count() {
        let mut c = AdvertiseCheck::new(&["*.svc.cluster.local".into(), "10.0.0.0/8".into()]);
        let now = Instant::now();
        let src: IpAddr = "192.168.1.1".parse().expect("ip");
        assert!(c.check("http://w-0.w.ns.svc.cluster.local:8000", src, now).is_ok());
        assert!(c.check("http://10.3.4.5:8000", src, now).is_ok());
        assert!(c.check("http://192.168.1.1:8000", src, now).is_err(), "the source alone is not enough then");
    }
}
