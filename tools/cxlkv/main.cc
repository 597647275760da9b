// cxlkv: the command line of the rack-scale KV-cache pool. `cxlkv --help` lists the commands.
#include <cstdio>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"cxlkv: a rack-scale KV-cache pool over shared (CXL) memory"};
  app.require_subcommand(1);
  cxlkv::cli::CommandResult result;
  cxlkv::cli::AddRegionCommands(app, result);
  cxlkv::cli::AddBenchCommands(app, result);
  cxlkv::cli::AddDemoCommands(app, result);
  cxlkv::cli::AddPoolCommands(app, result);
  cxlkv::cli::AddCacheCommands(app, result);
  cxlkv::cli::AddServeCommands(app, result);
  cxlkv::cli::AddLongContextCommands(app, result);
  cxlkv::cli::AddDaemonCommands(app, result);
  cxlkv::cli::AddGenerateCommands(app, result);
  cxlkv::cli::AddRacksCommands(app, result);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // One line, then the hint; usage errors exit 2 like most Unix tools.
    std::fprintf(stderr, "cxlkv: error: %s (see cxlkv --help)\n", e.what());
    return 2;
  }
  if (!result.status.ok()) {
    std::fprintf(stderr, "cxlkv: error: %s\n", result.status.ToString().c_str());
    return result.failure_exit_code;
  }
  return 0;
}
