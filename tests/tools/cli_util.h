// Runs the `cxlkv` binary (CXLKV_CLI, set by ctest) as a user would: its exit code, stdout, and
// stdout with stderr; a bench report's figures by name. Shared by the CLI tests.
#ifndef CXLKV_TESTS_TOOLS_CLI_UTIL_H_
#define CXLKV_TESTS_TOOLS_CLI_UTIL_H_

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace cxlkv::testing {

struct Output {
  int code = -1;
  std::string out;  // stdout and stderr together
  std::string stdout_only;
};

inline Output Cli(const std::string& args) {
  const char* cli = std::getenv("CXLKV_CLI");
  EXPECT_NE(cli, nullptr) << "CXLKV_CLI must point at the cxlkv binary (ctest sets it)";
  Output o;
  std::string err_file = "/tmp/cxlkv-cli-test-" + std::to_string(::getpid()) + ".err";
  std::string cmd = std::string(cli) + " " + args + " 2>" + err_file;
  FILE* p = ::popen(cmd.c_str(), "r");
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) o.stdout_only.append(buf.data(), n);
  int status = ::pclose(p);
  o.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  FILE* e = std::fopen(err_file.c_str(), "r");
  std::string err;
  while (e && (n = std::fread(buf.data(), 1, buf.size(), e)) > 0) err.append(buf.data(), n);
  if (e) std::fclose(e);
  ::unlink(err_file.c_str());
  o.out = o.stdout_only + err;
  return o;
}

// A `cxlkv bench NAME --json` report's figures by name.
inline std::map<std::string, nlohmann::json> FiguresByName(const nlohmann::json& report) {
  std::map<std::string, nlohmann::json> by_name;
  for (const auto& f : report["results"]) by_name[f["name"].get<std::string>()] = f;
  return by_name;
}

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_TOOLS_CLI_UTIL_H_
