// cxlkv demo: the main job on the embedded default (a region in /dev/shm). It grows with each
// capability; today it creates a region and prints what it holds.
#include <unistd.h>

#include <memory>
#include <string>

#include "commands.h"
#include "util/units.h"

namespace cxlkv::cli {

void AddDemoCommands(CLI::App& app, CommandResult& result) {
  struct Args {
    std::string path;
    std::string size = "256M";
  };
  auto args = std::make_shared<Args>();
  args->path = "/dev/shm/cxlkv-demo-" + std::to_string(::getuid());
  CLI::App* cmd = app.add_subcommand("demo", "Run the end-to-end demo on a region in /dev/shm");
  cmd->add_option("--path", args->path, "Region path (re-created)")->capture_default_str();
  cmd->add_option("--size", args->size, "Region size")->capture_default_str();
  cmd->callback([args, &result] {
    auto size = util::ParseByteSize(args->size);
    if (!size.ok()) {
      result.status = size.status();
      return;
    }
    RegionCreateOptions opts;
    opts.size = *size;
    opts.overwrite = true;
    auto created = Region::Create(args->path, opts);
    if (!created.ok()) {
      result.status = created.status();
      return;
    }
    std::printf("== demo: created a region at %s; attaching it again as another node would ==\n",
                args->path.c_str());
    auto attached = Region::Attach(args->path);
    if (!attached.ok()) {
      result.status = attached.status();
      return;
    }
    PrintRegionInfo((*attached)->info(), stdout);
  });
}

}  // namespace cxlkv::cli
