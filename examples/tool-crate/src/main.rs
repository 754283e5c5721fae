//! Serves the crate's three tools until SIGTERM or Ctrl-C; settings from the environment.

#[toolfleet_worker::main(tools = toolfleet_example_tools::tools())]
async fn main() {}
