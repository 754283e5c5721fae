//! Serves the crate's tools and the conformance probe until SIGTERM or Ctrl-C; settings
//! from the environment.

#[toolfleet_worker::main(tools = toolfleet_example_tools::served())]
async fn main() {}
