// `cxlkv generate`: greedy generation with the reference engine, one prompt, no pool. The
// yardstick other engines are compared with (the Python torch engine of python/cxlkv must give
// the same tokens for the same config and weights); --save-weights writes the seeded random
// weights it used, so another engine can load exactly them.
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "engine/config.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/weights.h"

namespace cxlkv::cli {
namespace {

struct GenerateArgs {
  std::string model_config, weights, save_weights, prompt;
  uint32_t max_new = 8;
  uint32_t block_size = 16;
};

Result<std::vector<int32_t>> ParseTokens(const std::string& text) {
  std::vector<int32_t> tokens;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    try {
      size_t used = 0;
      const long v = std::stol(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::out_of_range(item);
      tokens.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      return InvalidArgument("--prompt: '" + item + "' is not a token id (comma-separated non-negative integers)");
    }
  }
  if (tokens.empty()) return InvalidArgument("--prompt: no tokens (give comma-separated token ids)");
  return tokens;
}

Status Generate(const GenerateArgs& a) {
  engine::ModelConfig config;
  if (!a.model_config.empty()) {
    CXLKV_ASSIGN_OR_RETURN(config, engine::ModelConfig::Load(a.model_config));
  }
  CXLKV_RETURN_IF_ERROR(config.Validate());
  CXLKV_ASSIGN_OR_RETURN(auto tokens, ParseTokens(a.prompt));
  if (a.max_new == 0) return InvalidArgument("--max-new must be at least 1");
  CXLKV_ASSIGN_OR_RETURN(auto weights, a.weights.empty() ? engine::Weights::Random(config)
                                                           : engine::Weights::LoadSafetensors(config, a.weights));
  if (!a.save_weights.empty()) CXLKV_RETURN_IF_ERROR(weights.SaveSafetensors(a.save_weights));
  engine::Model model(config, std::move(weights));
  CXLKV_RETURN_IF_ERROR(model.status());
  const uint64_t positions = tokens.size() + a.max_new;
  const auto blocks = static_cast<uint32_t>((positions + a.block_size - 1) / a.block_size);
  engine::PagedKvCache cache(config, blocks, a.block_size);
  CXLKV_ASSIGN_OR_RETURN(auto table, cache.AllocateBlocks(blocks));
  CXLKV_ASSIGN_OR_RETURN(auto out, model.Generate(tokens, 0, a.max_new, cache, table));
  nlohmann::json j;
  j["model"] = config.name;
  j["prompt_tokens"] = tokens.size();
  j["tokens"] = out;
  std::printf("%s\n", j.dump().c_str());
  return Status::Ok();
}

}  // namespace

void AddGenerateCommands(CLI::App& app, CommandResult& result) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Greedy generation with the reference engine (prints JSON tokens)");
  cmd->add_option("--model-config", a->model_config, "Engine config JSON (default: the built-in tiny Llama)");
  cmd->add_option("--weights", a->weights, "safetensors weights (default: seeded random)");
  cmd->add_option("--save-weights", a->save_weights, "Write the weights used to this safetensors file");
  cmd->add_option("--prompt", a->prompt, "Prompt token ids, comma-separated")->required();
  cmd->add_option("--max-new", a->max_new, "Tokens to generate")->capture_default_str();
  cmd->add_option("--block-size", a->block_size, "KV block size (tokens)")->capture_default_str();
  cmd->callback([a, &result] { result.status = Generate(*a); });
}

}  // namespace cxlkv::cli
