//! Free loopback ports for local fleets that start a server on a port chosen beforehand (the tests, the benches,
//! `kvgate-loadtest`'s local fleet).
//!
//! A port taken from the kernel with `bind(":0")` and released again is an *ephemeral* port: until the server
//! binds it, any outgoing connection on the machine may be given the same port, and the server then fails with
//! "address already in use". So ports come from below the ephemeral range (Linux: 32768-60999) instead, each checked
//! by binding it; a per-process starting point and a counter keep concurrent test processes apart.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// The lowest port handed out.
pub const LOW_PORT: u16 = 15_000;
/// One past the highest port handed out (the start of Linux's default ephemeral range).
pub const HIGH_PORT: u16 = 32_768;

static NEXT: AtomicU32 = AtomicU32::new(0);
static START: OnceLock<u32> = OnceLock::new();

/// A loopback port nothing listens on now and the kernel does not hand out for outgoing connections.
pub fn free_loopback_port() -> std::io::Result<u16> {
    let span = u32::from(HIGH_PORT - LOW_PORT);
    let start = *START.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        // Spread processes over the range (Knuth's multiplicative hash of the pid, plus the clock).
        std::process::id().wrapping_mul(2_654_435_761).wrapping_add(nanos) % span
    });
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = LOW_PORT + ((start + n) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "no free loopback port below the ephemeral range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_below_the_ephemeral_range_distinct_and_bindable() {
        let ports: Vec<u16> = (0..20).map(|_| free_loopback_port().expect("port")).collect();
        assert!(ports.iter().all(|p| (LOW_PORT..HIGH_PORT).contains(p)), "{ports:?}");
        let mut sorted = ports.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ports.len(), "no port handed out twice: {ports:?}");
        let held = TcpListener::bind(("127.0.0.1", ports[0])).expect("the port is free");
        drop(held);
    }
}
