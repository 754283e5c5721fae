//! Serves the crate's three tools until SIGTERM or Ctrl-C; settings from the environment.

#[tokio::main]
async fn main() -> Result<(), toolfleet_worker::ServeError> {
    toolfleet_worker::serve(toolfleet_example_tools::tools()).await
}
