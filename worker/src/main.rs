//! kvgate-worker: the inference engine and its OpenAI server (issues #3 and #4).
//! Until they land, the binary refuses to start rather than pretend to serve.

fn main() {
    eprintln!(
        "kvgate-worker is not implemented yet (tracked in issues #3 and #4); see README.md for what exists."
    );
    std::process::exit(2);
}
