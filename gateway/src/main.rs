//! kvgate-gateway: the OpenAI-compatible pingora reverse proxy with cache-aware routing (issue #5).
//! Until it lands, the binary refuses to start rather than pretend to serve.

fn main() {
    eprintln!("kvgate-gateway is not implemented yet (tracked in issue #5); see README.md for what exists.");
    std::process::exit(2);
}
